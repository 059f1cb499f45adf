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


def test_core_imports_no_toolkit():
    loaded = loaded_after("import latent_core.sdma, latent_core.vae, latent_core.errors, latent_core.safe_loading")
    assert loaded["latent_core"]
    assert not any(loaded[m] for m in TOOLKITS + ("user_dir",)), loaded


def test_espnet_plugin_does_not_import_fairseq_or_the_fairseq_plugin():
    loaded = loaded_after("import espnet_plugin")
    assert loaded["espnet2"] and loaded["latent_core"]
    assert not loaded["fairseq"] and not loaded["user_dir"], loaded
