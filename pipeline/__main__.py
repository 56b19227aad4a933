"""specq's command line: one sub-command per stage.

    python -m pipeline prepare  --run runs/smollm2-135m --config configs/default.yaml --model smollm2-135m
    python -m pipeline quantize --run runs/smollm2-135m --config configs/default.yaml
    python -m pipeline gate-check --run runs/smollm2-135m      # the table; exit 0 go, 1 no-go, 3 inconclusive
    python -m pipeline config   --config configs/default.yaml  # prints the resolved config
    python -m pipeline summary  --run runs/smollm2-135m        # the decision and what to deploy (make evaluate's end)

Every stage exits 0 on success (or when it is already up to date), 2 with one line on stderr when
the input is bad (a config, stage or decode-engine error); gate-check exits 1 on no-go and 3 on
inconclusive (pipeline/stages/gate.py).
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in [*STAGES, "gate-check", "config", "evaluate", "summary"]:
        sp = sub.add_parser(name)
        sp.add_argument("--config", default="configs/default.yaml")
        sp.add_argument("--run", default=None, help="run directory (default runs/<slug of MODEL>)")
        sp.add_argument("--model", default="smollm2-135m", help="alias, local HF dir or hub id")
        sp.add_argument("--drafts", default="", help="space-separated drafts; overrides the config")
        sp.add_argument("--force", action="store_true", help="re-run even if up to date")
        sp.add_argument("--no-exit-code", action="store_true", help="gate-check: print, exit 0")
    return p


def main(argv: list[str] | None = None) -> int:
    set_up_process(quiet=True)
    args = _parser().parse_args(argv)
    try:
        overrides = {"drafts": args.drafts.split()} if args.drafts.strip() else {}
        cfg = load_config(args.config, overrides)
        if args.command == "config":
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        run_dir = Path(args.run or f"runs/{slug(args.model)}")
        if args.command == "summary":
            from pipeline.report.summary import summary_lines

            print("\n".join(summary_lines(run_dir)))
            return 0
        if args.command == "gate-check":
            from pipeline.stages.gate import gate_check

            rc = gate_check(run_dir)
            return 0 if args.no_exit_code else rc
        names = list(STAGES) if args.command == "evaluate" else [args.command]
        if args.command in ("evaluate", "prepare"):  # make evaluate starts with prepare: refuse
            from pipeline.speculation.workload import precheck as workload_precheck  # a bad workload file
            from pipeline.stages.quality import precheck  # unknown quality tasks before any work
            from pipeline.stages.vllm_engine import precheck as vllm_precheck  # vLLM asked for, not installed

            workload_precheck(cfg, {})
            precheck(cfg, {})
            vllm_precheck(cfg, {})
        for name in names:
            stage_args = {"model": args.model} if name == "prepare" else {}
            if name in ("acceptance", "vllm", "latency"):  # installing vLLM re-runs the stages it changes
                from pipeline.stages.targets import engine_args

                stage_args = engine_args(cfg)
            run_stage(STAGES[name], run_dir, cfg, stage_args, STAGES, force=args.force)
            if name == "prepare":  # the run's first stage (make evaluate runs it first), once MODEL is known good
                progress(f"specq: {plan_line(cfg)}")
        return 0
    except (ConfigError, StageError, EngineError) as e:
        print(f"specq: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specq: interrupted; finished items are kept, the stage will resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
