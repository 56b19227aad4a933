"""specq's command line (`specq`, or `python -m pipeline`): `specq <command> --help` says what each takes.

    specq evaluate --model smollm2-135m                   # every stage, then the summary
    specq quantize --run runs/smollm2-135m --config configs/default.yaml
    specq gate     --run runs/smollm2-135m [--variant int8] [--table]   # exit 0 go, 1 no-go, 3 inconclusive
    specq summary  --run runs/smollm2-135m                # the decision and what to deploy
    specq config   --config configs/default.yaml          # the resolved config

Every stage exits 0 on success (or up to date), 2 with one line on stderr on bad input. `gate`
exits with the decision (0 go, 1 no-go, 3 inconclusive); `gate-check` is `gate --table` on a gated run.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pipeline.core.budget import plan_line
from pipeline.core.config import ConfigError, load_config
from pipeline.core.process import set_up_process
from pipeline.core.stage import StageError, progress, run_stage
from pipeline.decode.errors import EngineError
from pipeline.stages.table import STAGES


def slug(model: str) -> str:
    """The default run name for a MODEL: its last path component, lower-cased, made file-safe."""
    name = model.rstrip("/").split("/")[-1] or "model"
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"


STAGE_HELP = {
    "prepare": "resolve MODEL and write the run's model directory",
    "quantize": "write each quantized variant beside the reference",
    "drafts": "build the draft models",
    "acceptance": "per-position acceptance, derived teacher-forced in specq's engine",
    "vllm": "speculation measured in vLLM: acceptance, latency across k, the config to deploy",
    "latency": "decode latency in specq's engine (the pairs vLLM does not measure)",
    "marginal": "the marginal cost of each k and the recommendation",
    "quality": "score every variant on the quality slices",
    "gate": "the release decision (the gate stage)",
    "report": "the report: HTML and Markdown",
}


def _run_flags(sp: argparse.ArgumentParser, force: bool = True) -> None:
    """The flags that find (or make) a run: every command that reads one takes them."""
    sp.add_argument("--config", default="configs/default.yaml", help="config YAML (default: %(default)s)")
    sp.add_argument("--run", default=None, help="run directory (default: runs/<slug of MODEL>)")
    sp.add_argument("--model", default="smollm2-135m", help="alias, local HF dir or hub id (default: %(default)s)")
    sp.add_argument("--drafts", default="", help="space-separated draft specs; overrides the config's drafts")
    if force:
        sp.add_argument("--force", action="store_true", help="re-run even if up to date")


def _parser(prog: str = "specq") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="specq: quantization and speculative-decoding release gate")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    ev = sub.add_parser("evaluate", help="every stage in order, then the summary")
    _run_flags(ev)
    for name in STAGES:
        if name == "gate":
            continue
        _run_flags(sub.add_parser(name, help=f"stage: {STAGE_HELP.get(name, name)}"))
    gate = sub.add_parser("gate", help="the release decision: exit 0 go, 1 no-go, 3 inconclusive, 2 bad input")
    _run_flags(gate)
    gate.add_argument("--variant", action="append", default=[], metavar="V",
                      help="decide on this release variant only (repeat for several)")
    gate.add_argument("--table", action="store_true", help="print the full table (every variant and slice)")
    gate.add_argument("--no-exit-code", action="store_true", help="print the decision, exit 0")
    gate.add_argument("--stage-only", action="store_true", help="run the gate stage, print nothing, exit 0")
    check = sub.add_parser("gate-check", help="the table of a gated run and its exit status (= gate --table)")
    _run_flags(check, force=False)
    check.add_argument("--no-exit-code", action="store_true", help="print the table, exit 0")
    summ = sub.add_parser("summary", help="the decision and what to deploy, in one screen")
    _run_flags(summ, force=False)
    conf = sub.add_parser("config", help="print the resolved config (JSON)")
    conf.add_argument("--config", default="configs/default.yaml", help="config YAML (default: %(default)s)")
    conf.add_argument("--drafts", default="", help="space-separated draft specs; overrides the config's drafts")
    conf.add_argument("--explain", action="store_true",
                      help="print every key with its type, default and meaning (Markdown) instead")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m pipeline") -> int:
    set_up_process(quiet=True)
    args = _parser(prog).parse_args(argv)
    try:
        overrides = {"drafts": args.drafts.split()} if args.drafts.strip() else {}
        cfg = load_config(args.config, overrides)
        if args.command == "config":
            if args.explain:
                from pipeline.core.config_doc import render

                print(render(), end="")
                return 0
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        run_dir = Path(args.run or f"runs/{slug(args.model)}")
        if args.command in ("gate", "gate-check"):
            from pipeline.stages.gate import gate_check

            if args.command == "gate":
                run_stage(STAGES["gate"], run_dir, cfg, {}, STAGES, force=args.force)
                if args.stage_only:
                    return 0
            rc = gate_check(run_dir, getattr(args, "variant", None) or None, getattr(args, "table", True))
            return 0 if args.no_exit_code else rc
        names = {"evaluate": list(STAGES), "summary": []}.get(args.command, [args.command])
        if args.command in ("evaluate", "prepare"):  # make evaluate starts with prepare: refuse
            from pipeline.speculation.workload import precheck as workload_precheck  # a bad workload file
            from pipeline.stages.quality import precheck as quality_precheck  # unknown quality tasks
            from pipeline.stages.vllm_engine import precheck as vllm_precheck  # vLLM asked for, not installed

            for precheck in (workload_precheck, quality_precheck, vllm_precheck):
                precheck(cfg, {})
        for name in names:
            stage_args = {"model": args.model} if name == "prepare" else {}
            if name in ("acceptance", "vllm", "latency"):  # installing vLLM re-runs the stages it changes
                from pipeline.stages.targets import engine_args

                stage_args = engine_args(cfg)
            run_stage(STAGES[name], run_dir, cfg, stage_args, STAGES, force=args.force)
            if name == "prepare":  # the run's first stage (make evaluate runs it first), once MODEL is known good
                progress(f"specq: {plan_line(cfg)}")
        if args.command in ("evaluate", "summary"):
            from pipeline.report.summary import summary_lines

            print("\n".join(summary_lines(run_dir)))
        return 0
    except (ConfigError, StageError, EngineError) as e:
        print(f"specq: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specq: interrupted; finished items are kept, the stage will resume", file=sys.stderr)
        return 130


def cli() -> None:
    """The `specq` console script."""
    sys.exit(main(prog="specq"))


if __name__ == "__main__":
    sys.exit(main())
