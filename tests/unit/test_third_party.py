"""trainwise.third_party: torchao's import-time notes, which transformers triggers by
importing it whenever a model is loaded, stay off a CPU machine's stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import hang_limit

pytest.importorskip("torchao")


@pytest.mark.timeout(hang_limit(launches=1, procs=1))
def test_importing_torchao_after_trainwise_says_nothing_on_a_machine_without_cuda():
    code = "import torch, trainwise, torchao; assert not torch.cuda.is_available()"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=hang_limit(launches=1, procs=1))
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


@pytest.mark.timeout(hang_limit(launches=1, procs=1))
def test_without_trainwise_torchao_would_have_said_it():
    # The filter is what keeps it quiet: torchao alone warns (so the test above can fail).
    loud = subprocess.run([sys.executable, "-c", "import torchao"], capture_output=True,
                          text=True, timeout=hang_limit(launches=1, procs=1))
    assert "Failed to load" in loud.stderr or "is an Enum subclass" in loud.stderr
