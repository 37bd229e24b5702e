"""Run by tests/benchmarks/test_bench_real_shapes.py: one script's command lines, each run as `python SCRIPT ARGS`
runs it (as __main__, with that sys.argv), one after the other in this one process, so torch's and transformers'
imports are paid once for all of them. Prints each run's exit code last, as one JSON line.

usage: command_lines.py SCRIPT '[["--flag", ...], ...]'"""

import json
import runpy
import sys
import traceback

script, command_lines = sys.argv[1], json.loads(sys.argv[2])
codes = []
for args in command_lines:
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception:  # noqa: BLE001 - a failing run prints its traceback; the next still runs
        traceback.print_exc()
        code = 1
    print(f"exit code {code}: {script} {' '.join(args)}", flush=True)
    codes.append(code)
print(json.dumps({"exit_codes": codes}))
