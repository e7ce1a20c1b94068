"""The real llama.cpp ``llama-server`` beside us on the real SmolLM2 GGUF: slow and opt-in.

Run by ``make test-peers`` (or ``make test-peers-llamacpp``, which needs no vLLM), never by
``make test``: unless a ``llama-server`` is on PATH or already built under
``$SPECDECODE_HOME/peers/``, the first run builds llama.cpp from its pinned source (cmake and a C++
compiler), which takes minutes. tests/test_llamacpp_peer.py tests our side of the peer against a
stub server.
"""

from __future__ import annotations

import json
import shutil

from specdecode.bench import llamacpp_build
from specdecode.cli import main


def test_the_real_llamacpp_agrees_with_us_on_smollm2(tmp_path):
    """The real llama-server (on PATH, or built once from the pinned sdist) on the real SmolLM2
    GGUF: it runs, reports tokens, and mostly agrees with ours."""
    server = llamacpp_build.find_llama_server(None)
    out = tmp_path / "out"
    code = main(["bench", "--no-progress", "--out", str(out), "--model", "smollm2-135m-instruct", "--methods",
                 "none", "--workload", "code", "--limit", "1", "--max-tokens", "24", "--peers", "llamacpp",
                 "--llamacpp-server", str(server)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    peer = summary["peers"]["llamacpp_target"]
    assert peer["compared_tokens"] > 0 and peer["agreed_tokens"] >= 8, peer
    assert shutil.which(str(server))
