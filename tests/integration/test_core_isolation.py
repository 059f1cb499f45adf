"""The toolkit-free core stays toolkit-free, and the ESPnet plugin does not pull in fairseq.

Each check runs in a fresh interpreter: this test process has imported everything already.
"""

import json
import subprocess
import sys

from conftest import REPO

TOOLKITS = ("fairseq", "espnet", "espnet2", "transformers")


def loaded_after(statement: str) -> dict:
    code = (f"import json, sys; {statement}; "
            f"print(json.dumps({{m: m in sys.modules for m in {list(TOOLKITS) + ['user_dir', 'latent_core']!r}}}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# the toolkit-free tools and data preparation (named, so that a module
# that disappears fails here instead of being skipped by the walk below)
CORE_TOOLS = ("latent_core.redundancy", "latent_core.redundancy_plot", "latent_core.runs", "latent_core.peak_rss",
              "latent_core.op_counts",
              "latent_core.data.registry", "latent_core.data.ding", "latent_core.data.english_vae",
              "latent_core.data.lee_sts", "latent_core.data.pattern3", "latent_core.data.iwslt14",
              "latent_core.data.translation", "latent_core.data.mandarin_synth")


def test_core_imports_no_toolkit():
    loaded = loaded_after("import latent_core.sdma, latent_core.vae, latent_core.errors, latent_core.safe_loading")
    assert loaded["latent_core"]
    assert not any(loaded[m] for m in TOOLKITS + ("user_dir",)), loaded


def test_every_core_module_imports_no_toolkit():
    """Every module of the latent_core package (found by walking it), the tools included."""
    loaded = loaded_after(f"import importlib, pkgutil, latent_core; [importlib.import_module(m) for m in "
                          f"{list(CORE_TOOLS)!r}]; [importlib.import_module(m.name) for m in "
                          f"pkgutil.walk_packages(latent_core.__path__, 'latent_core.')]")
    assert loaded["latent_core"]
    assert not any(loaded[m] for m in TOOLKITS + ("user_dir",)), loaded


def test_espnet_plugin_does_not_import_fairseq_or_the_fairseq_plugin():
    loaded = loaded_after("import espnet_plugin, espnet_plugin.asr.redundancy, espnet_plugin.recipes.synthetic")
    assert loaded["espnet2"] and loaded["latent_core"]
    assert not loaded["fairseq"] and not loaded["user_dir"], loaded


def test_fairseq_plugin_import_leaves_transformers_and_espnet_to_the_models_that_use_them():
    """``--user-dir user_dir`` imports the plugin in every fairseq command: transformers (about 3 s
    of start-up) is imported where a BERT/GPT-2 model is built, not at registration."""
    loaded = loaded_after("import user_dir")
    assert loaded["user_dir"] and loaded["fairseq"]
    assert not any(loaded[m] for m in ("transformers", "espnet", "espnet2")), loaded
