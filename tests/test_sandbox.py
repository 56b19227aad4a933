"""Generated code runs contained: a separate process with a time limit, a memory limit, no new
processes and no network. A completion that loops forever, allocates without bound or calls
os.system scores 0, nothing it tried happens, and the pipeline's process is unaffected."""
from __future__ import annotations

import resource
import socket
import threading
import time

import pytest

from evals import humaneval, sandbox

LIMITS = sandbox.Limits(seconds=3.0, memory_bytes=256 << 20)
PROBLEM = next(p for p in humaneval.items(None) if p["id"] == "HumanEval/0")  # has_close_elements
BODY_OK = PROBLEM["target"]


@pytest.fixture
def world_writable(tmp_path):
    """A directory anyone (the sandbox's nobody included) may write to: if a marker file appears
    in it, the sandbox let the program do what it tried."""
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    tmp_path.chmod(0o755)
    return d


def test_hostile_completions_are_contained_and_score_zero(world_writable):
    marker_system = world_writable / "via_os_system"
    marker_posix = world_writable / "via_posix_system"
    marker_spawn = world_writable / "via_posix_spawn"
    completions = {
        "correct": BODY_OK,
        "loops forever": "    while True:\n        pass\n",
        "sleeps forever": "    import time\n    time.sleep(10 ** 6)\n",
        "allocates without bound": "    hoard = []\n    while True:\n        hoard.append(bytearray(1 << 26))\n",
        "one huge allocation": "    return [0] * (10 ** 10)\n",
        "os.system": f"    import os\n    os.system('touch {marker_system}')\n    return True\n",
        # Past the Python guard: only the process limit (RLIMIT_NPROC as nobody) stops these.
        "posix.system": f"    import posix\n    posix.system('touch {marker_posix}')\n    return True\n",
        "posix_spawn": ("    import posix\n"
                        f"    posix.posix_spawn('/usr/bin/touch', ['touch', '{marker_spawn}'], {{}})\n"
                        "    return True\n"),
        "exits before its tests": "    import os\n    os._exit(0)\n",
        "prints without end": "    while True:\n        print('x' * 10000)\n",
    }
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    results = humaneval.score([PROBLEM] * len(completions), list(completions.values()), LIMITS, workers=2)
    elapsed = time.perf_counter() - start
    by_name = dict(zip(completions, results))
    assert by_name["correct"]["pass@1"] == 1.0 and by_name["correct"]["status"] == "passed"
    for name, r in by_name.items():
        if name != "correct":
            assert r["pass@1"] == 0.0, (name, r)
    assert by_name["loops forever"]["status"] == "timeout"
    assert by_name["sleeps forever"]["status"] == "timeout"
    assert "MemoryError" in by_name["allocates without bound"]["detail"]
    assert "MemoryError" in by_name["one huge allocation"]["detail"]
    assert "os.system is disabled" in by_name["os.system"]["detail"]
    assert by_name["exits before its tests"]["status"] == "exited"
    assert not marker_system.exists()
    if "RLIMIT_NPROC does not bind" not in sandbox.isolation()["user"]:
        assert not marker_posix.exists() and not marker_spawn.exists()
        assert "Resource temporarily unavailable" in by_name["posix_spawn"]["detail"]
    # Ten programs, two at a time, two of them timing out at 3 s: well under ten times the limit.
    assert elapsed < 4 * LIMITS.seconds + 10
    # The allocations happened in the children: this process did not grow by hundreds of MB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


def test_no_network():
    """A server in this process on 127.0.0.1: the sandboxed program cannot reach it, neither
    through the socket module (guarded) nor through _socket (only the namespace stops that)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        via_socket = sandbox.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n", LIMITS)
        via_raw = sandbox.run_python(f"import _socket\ns = _socket.socket()\ns.settimeout(2)\n"
                                     f"s.connect(('127.0.0.1', {port}))\n", LIMITS)
    finally:
        server.close()
    assert not via_socket.passed and "disabled" in via_socket.detail
    if sandbox.isolation()["network"].startswith("own empty namespace"):
        assert not via_raw.passed and not accepted
    else:
        pytest.skip("no network namespace on this machine; only the socket guard applies")


def test_outcomes_keep_their_order_and_report_failures():
    programs = ["assert 1 + 1 == 2\n", "assert 1 + 1 == 3, 'arithmetic'\n", "raise ValueError('bad')\n",
                "import sys\nsys.exit(0)\n", "print('fine')\n"]
    out = sandbox.run_many(programs, LIMITS, workers=2)
    assert [o.passed for o in out] == [True, False, False, False, True]
    assert out[1].detail == "AssertionError: arithmetic" and out[2].detail == "ValueError: bad"
    assert out[3].status == "exited"


def test_code_task_yaml_filter_runs_the_sandbox():
    """The code slice's lm-eval filter scores what lm-eval hands it: canonical solutions pass,
    an empty body fails."""
    import tempfile
    from pathlib import Path

    from lm_eval.tasks import TaskManager, get_task_dict

    from pipeline.quality.items import builtin_task_config

    rows = humaneval.items(4)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "code.jsonl"
        data.write_bytes(humaneval.to_jsonl(rows))
        cfg = builtin_task_config("code", data, max_new_tokens=64)
        task = get_task_dict([cfg], TaskManager(include_defaults=False))[cfg["task"]]
        docs = list(task.test_docs())
        assert [d["id"] for d in docs] == [r["id"] for r in rows]
        assert task.config.generation_kwargs["max_gen_toks"] == 64
        run = cfg["filter_list"][0]["filter"][0]["filter_fn"]
        outcomes = run([[d["target"]] for d in docs] + [["    pass\n"]], docs + docs[:1])
    assert [o["pass@1"] for o in outcomes] == [1.0] * 4 + [0.0]
    assert task.process_results(docs[0], [outcomes[0]]) == {"pass@1": 1.0}
