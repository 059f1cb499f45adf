"""The layers: ``latent_core`` is mathematics that knows no toolkit, ``pipelines`` and the benchmarks' measurement
helpers import no toolkit at module level, and the ESPnet plugin does not pull in fairseq.

Each import check runs in a fresh interpreter: this test process has imported everything already.
"""

import ast
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


# named, so that a module that disappears fails here instead of being skipped by the walks below
CORE_TOOLS = ("latent_core.redundancy", "latent_core.redundancy_plot")
# the measurement helpers of the benchmarks and tests: any callable or command, whichever toolkit it runs
MEASUREMENT = ("benchmarks.peak_rss", "benchmarks.op_counts")
PIPELINES = ("pipelines.runs", "pipelines.kaldi_data", "pipelines.data.registry", "pipelines.data.ding",
             "pipelines.data.english_vae", "pipelines.data.lee_sts", "pipelines.data.pattern3",
             "pipelines.data.iwslt14", "pipelines.data.translation", "pipelines.data.mandarin_synth",
             "pipelines.data.bert_source", "pipelines.data.optimus_text", "pipelines.data.bart_data")
# what latent_core may not import anywhere, inside functions included
NOT_IN_CORE = TOOLKITS + ("user_dir", "espnet_plugin", "transformers_plugin", "pipelines", "benchmarks", "experiments")


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


def test_measurement_helpers_import_no_toolkit():
    loaded = loaded_after(f"import importlib; [importlib.import_module(m) for m in {list(MEASUREMENT)!r}]")
    assert not any(loaded[m] for m in TOOLKITS + ("user_dir",)), loaded


def test_core_source_imports_no_toolkit_and_no_project_package_anywhere():
    """Every import statement of every latent_core file, also those inside functions (which the
    import checks above cannot see): the core is mathematics only."""
    offenders = []
    for path in sorted((REPO / "latent_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in NOT_IN_CORE]
    assert not offenders, offenders


def test_pipelines_import_no_toolkit_at_module_level():
    loaded = loaded_after(f"import importlib, pkgutil, pipelines; [importlib.import_module(m) for m in "
                          f"{list(PIPELINES)!r}]; [importlib.import_module(m.name) for m in "
                          f"pkgutil.walk_packages(pipelines.__path__, 'pipelines.')]")
    assert not any(loaded[m] for m in TOOLKITS + ("user_dir",)), loaded


def test_espnet_plugin_does_not_import_fairseq_or_the_fairseq_plugin():
    loaded = loaded_after("import espnet_plugin, espnet_plugin.tools.redundancy, experiments.espnet.synthetic_asr")
    assert loaded["espnet2"] and loaded["latent_core"]
    assert not loaded["fairseq"] and not loaded["user_dir"], loaded


def test_fairseq_plugin_import_leaves_transformers_and_espnet_to_the_models_that_use_them():
    """``--user-dir user_dir`` imports the plugin in every fairseq command: transformers (about 3 s
    of start-up) is imported where a BERT/GPT-2 model is built, not at registration."""
    loaded = loaded_after("import user_dir")
    assert loaded["user_dir"] and loaded["fairseq"]
    assert not any(loaded[m] for m in ("transformers", "espnet", "espnet2")), loaded


def test_transformers_plugin_imports_neither_toolkit():
    """The third adapter is for Hugging Face users: every module of it imports neither fairseq nor ESPnet
    (nor the other adapters)."""
    loaded = loaded_after("import importlib, pkgutil, transformers_plugin; [importlib.import_module(m.name) for m "
                          "in pkgutil.walk_packages(transformers_plugin.__path__, 'transformers_plugin.')]")
    assert loaded["transformers"] and loaded["latent_core"]
    assert not any(loaded[m] for m in ("fairseq", "espnet", "espnet2", "user_dir")), loaded
