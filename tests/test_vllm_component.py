"""vLLM as a component, without vLLM: the server's life cycle (start, readiness, a taken port, a
crash, a hang, Ctrl-C and SIGTERM mid-stage) against a stand-in server (tests/fake_vllm.py), the
client's reading of a stream and of /metrics, and what specq hands vLLM (speculative_config,
the serve line, which variants it can serve)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fake_vllm import write_fake_vllm
from pipeline.core.stage import StageError
from pipeline.vllm.client import complete, counter_delta, parse_counters, spec_counters
from pipeline.vllm.server import Server, last_error_line
from pipeline.vllm.spec_config import (draft_method, method_reason, serve_command, server_args, speculative_config,
                                       target_reason)

REPO = Path(__file__).resolve().parent.parent

def _interruptible() -> None:
    """In the child: Ctrl-C as a terminal sends it, even when the tests run in the background (a
    shell starts background jobs with SIGINT ignored, and the child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Every pid gone within a few seconds (a SIGKILL is delivered, not waited for)."""
    deadline = time.time() + within_s
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _pids(path: Path) -> list[int]:
    return [int(x) for line in path.read_text().splitlines() for x in line.split()] if path.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = write_fake_vllm(tmp_path / "fake")
    pids = tmp_path / "pids.txt"
    env = {"PYTHONPATH": str(root), "FAKE_VLLM_PIDS": str(pids)}
    return {"env": env, "pids": pids, "log": tmp_path / "logs" / "engine.log"}


def _server(fake, args=(), **kw) -> Server:
    return Server("model-dir", list(args), fake["log"], env=fake["env"], python=Path(sys.executable),
                  startup_timeout_s=kw.pop("startup_timeout_s", 30), **kw)


def test_server_starts_answers_and_stops_with_its_children(fake):
    with _server(fake) as srv:
        assert srv.healthy() and srv.port and srv.start_s > 0
        pids = _pids(fake["pids"])
        assert len(pids) == 2 and all(_alive(p) for p in pids) and srv.alive()
    assert _gone(pids), "the server or its engine-core child outlived the block"
    assert srv.proc is None
    assert "# specq: starting" in fake["log"].read_text()


def test_server_stops_when_the_block_raises(fake):
    with pytest.raises(RuntimeError):
        with _server(fake):
            raise RuntimeError("a stage error")
    assert _gone(_pids(fake["pids"]))


def test_taken_port_moves_to_another(fake):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken])
        with _server(fake, port_chooser=lambda: next(ports, None) or _free()) as srv:
            assert srv.port != taken and srv.healthy()
    assert "address already in use" in fake["log"].read_text().lower()


def _free() -> int:
    from pipeline.vllm.server import free_port
    return free_port()


def test_crash_while_starting_is_one_line_with_the_cause(fake):
    fake["env"]["FAKE_VLLM_MODE"] = "crash"
    with pytest.raises(StageError) as e:
        with _server(fake):
            pass
    msg = str(e.value)
    assert "\n" not in msg and "exited while starting" in msg and "ValueError" in msg
    assert _gone(_pids(fake["pids"]))


def test_no_readiness_times_out_and_stops(fake):
    fake["env"]["FAKE_VLLM_MODE"] = "hang"
    t0 = time.time()
    with pytest.raises(StageError, match="not ready after 3 s"):
        with _server(fake, startup_timeout_s=3):
            pass
    assert time.time() - t0 < 30
    assert _gone(_pids(fake["pids"]))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_stage_leaves_no_engine(fake, tmp_path, sig):
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from pipeline.vllm.server import Server
        try:
            with Server("m", [], Path({str(fake['log'])!r}), env={fake['env']!r}, python=Path(sys.executable)) as s:
                print("READY", flush=True)
                time.sleep(600)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(130)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=_interruptible)
    assert proc.stdout.readline().strip() == "READY"
    pids = _pids(fake["pids"])
    assert pids and all(_alive(p) for p in pids)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 130
    assert proc.stdout.read().strip() == "INTERRUPTED"
    assert _gone(pids), "an engine process outlived the interrupted stage"


def test_killed_stage_takes_its_server_with_it(fake, tmp_path):
    """SIGKILL cannot be caught: the server is asked to die with its parent (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux's")
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from pipeline.vllm.server import Server
        with Server("m", [], Path({str(fake['log'])!r}), env={fake['env']!r}, python=Path(sys.executable)):
            print("READY", flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=_interruptible)
    assert proc.stdout.readline().strip() == "READY"
    leader = _pids(fake["pids"])[0]
    proc.kill()
    proc.wait(timeout=30)
    assert _gone([leader])
    for pid in _pids(fake["pids"]):  # the fake's own child has no death signal: tidy up
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_client_reads_steps_spec_metrics_and_counters(fake):
    spec = speculative_config("ngram", 3, None)
    with _server(fake, ["--speculative-config", __import__("json").dumps(spec)]) as srv:
        before = spec_counters(srv.url)
        c = complete(srv.url, {"prompt": [1, 2, 3], "max_tokens": 12, "temperature": 0.0})
        after = spec_counters(srv.url)
    steps = [len(s) for s in c.step_ids]
    assert c.prompt_tokens == 3 and steps[0] == 1 and sum(steps) == 12 and max(steps) <= 4
    assert c.finish_reason == "length" and c.step_times == sorted(c.step_times)
    assert c.spec["per_step_accepted"] == [s - 1 for s in steps[1:]]
    d = counter_delta(after, before)
    assert d["num_drafts"] == len(steps) - 1
    assert d["accepted_per_pos"] == [sum(a >= i for a in c.spec["per_step_accepted"]) for i in (1, 2, 3)]


def test_parse_counters_sums_engines_and_positions():
    text = textwrap.dedent("""
        # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
        vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 6.0
        vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 16.0
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
        vllm:num_requests_running{engine="0",model_name="m"} 0.0
    """)
    c = parse_counters(text)
    assert c == {"num_drafts": 10.0, "num_draft_tokens": 16.0, "num_accepted_tokens": 10.0,
                 "accepted_per_pos": [5.0, 3.0]}


def test_last_error_line_prefers_the_cause():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as fh:
        fh.write("INFO starting\nWARNING Found ulimit of 20000 and failed to increase\n"
                 "pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                 "  Value error, --per-request-spec-decode-metrics requires speculative decoding\n"
                 "    For further information visit https://errors.pydantic.dev\n")
    assert last_error_line(Path(fh.name)).startswith("Value error, --per-request")


def test_speculative_configs_per_draft_kind(tmp_path):
    run = tmp_path / "run"
    assert draft_method("ngram", run) == {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert draft_method("ngram:5", run)["prompt_lookup_max"] == 5
    assert draft_method("self:w4a16-gptq", run) == {"method": "draft_model",
                                                    "model": str(run / "variants" / "w4a16-gptq")}
    assert draft_method("eagle3:/heads/h", run)["method"] == "eagle3"
    assert "no layer-skip" in draft_method("layerskip:8", run)
    cfg = speculative_config("self:w4a16-gptq", 3, run, by_batch=[[1, 3, 3], [4, 4, 0]])
    assert cfg["num_speculative_tokens"] == 3 and cfg["num_speculative_tokens_per_batch_size"] == [[1, 3, 3], [4, 4, 0]]
    with pytest.raises(ValueError):
        speculative_config("ngram", 0, run)
    line = serve_command("/m/my model", cfg)
    assert line.startswith("vllm serve '/m/my model' --speculative-config '{")
    assert '"num_speculative_tokens":3' in line
    assert serve_command("/m", None) == "vllm serve /m"


def test_server_args_and_what_vllm_serves():
    args = server_args(dtype="bfloat16", max_model_len=2048, seed=0, platform="cpu", enforce_eager=True,
                       max_num_seqs=8, spec={"method": "ngram", "num_speculative_tokens": 2},
                       extra={"enable_chunked_prefill": True, "kv_cache_dtype": "auto", "skip": False})
    assert "--enforce-eager" in args and "--per-request-spec-decode-metrics" in args
    assert "--enable-chunked-prefill" in args and args[args.index("--kv-cache-dtype") + 1] == "auto"
    assert "--skip" not in args and "--tensor-parallel-size" not in args
    plain = server_args(dtype="bfloat16", max_model_len=2048, seed=0, platform="cuda", enforce_eager=False,
                        max_num_seqs=8, tensor_parallel_size=2)
    assert "--per-request-spec-decode-metrics" not in plain  # vLLM refuses it without speculation
    assert plain[plain.index("--tensor-parallel-size") + 1] == "2"
    assert target_reason("none", None, "cpu") is None
    assert target_reason("gptq", "gptq", "cpu") is None
    assert "CPU backend" in target_reason("bnb-nf4", "bitsandbytes", "cpu")
    assert target_reason("bnb-nf4", "bitsandbytes", "cuda") is None
    assert "torchao" in target_reason("torchao-int8wo", None, "cuda")
    assert "not one vLLM reads" in method_reason("my-method")


def test_engine_dying_mid_request_is_one_line(fake):
    from pipeline.vllm.client import EngineDied

    fake["env"]["FAKE_VLLM_MODE"] = "die"
    with _server(fake) as srv:
        with pytest.raises(EngineDied) as e:
            complete(srv.url, {"prompt": [1, 2], "max_tokens": 8, "temperature": 0.0})
        assert "\n" not in str(e.value) and "stopped answering" in str(e.value)
        deadline = time.time() + 10
        while srv.alive() and time.time() < deadline:
            time.sleep(0.1)
        assert not srv.alive()


def test_vllm_asked_for_but_not_installed_stops_before_work(tmp_path, monkeypatch, capsys):
    from pipeline.__main__ import main
    import pipeline.vllm.env as env

    monkeypatch.setenv("SPECQ_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    env._probe.cache_clear()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("speculation_engine: vllm\n")
    run = tmp_path / "run"
    assert main(["evaluate", "--run", str(run), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculation_engine vllm: the vLLM environment is not installed" in err[0]
    assert not run.exists()


def test_auto_without_vllm_falls_back_to_specq(tmp_path, monkeypatch):
    from pipeline.core.config import load_config
    from pipeline.stages.targets import engine_args
    from pipeline.vllm.env import speculation_engine
    import pipeline.vllm.env as env

    monkeypatch.setenv("SPECQ_VLLM_PYTHON", str(tmp_path / "none"))
    env._probe.cache_clear()
    cfg = load_config(REPO / "configs/default.yaml")
    engine, why = speculation_engine(cfg)
    assert engine == "specq" and "not installed" in why
    assert engine_args(cfg) == {"engine": "specq", "vllm": None}


def test_speculation_targets_are_the_release_variants(tmp_path):
    """By default both engines measure every release variant (the reference when listed, or when
    nothing is released); a self-draft is never paired with itself."""
    import pipeline.stages.targets as targets
    from pipeline.core.config import load_config

    cfg = load_config(REPO / "configs/default.yaml")
    assert targets.speculation_targets(cfg, tmp_path) == ["w4a16-gptq", "int8", "nf4"]
    assert targets.vllm_targets(cfg) == ["w4a16-gptq", "int8", "nf4"]
    solo = load_config(REPO / "configs/default.yaml", {"quantize": {"variants": {"bf16": {"scheme": "none"}}}})
    assert targets.speculation_targets(solo, tmp_path) == ["bf16"] and targets.vllm_targets(solo) == ["bf16"]
    listed = load_config(REPO / "configs/default.yaml", {"vllm": {"targets": ["bf16", "w4a16-gptq"]}})
    assert targets.vllm_targets(listed) == ["bf16", "w4a16-gptq"]
    written = cfg.model_copy(update={"acceptance": cfg.acceptance.model_copy(update={"targets": ["nf4"]})})
    assert targets.speculation_targets(written, tmp_path) == ["nf4"]
    said = []
    assert targets.engine_drafts(["ngram", "self:w4a16-gptq"], "w4a16-gptq", "acceptance", said.append) == ["ngram"]
    assert "the draft is the target itself" in said[0]
