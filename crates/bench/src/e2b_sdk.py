# Times E2B's Python SDK against a sandpit daemon: Sandbox.create() -> the first
# commands.run("true") finished, then kill (not timed). Prints the milliseconds as JSON.
# E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL come from `sandpit bench`.
import json
import sys
import time

from e2b import Sandbox

runs = int(sys.argv[1])
template = sys.argv[2]
samples = []
for _ in range(runs):
    started = time.perf_counter()
    sbx = Sandbox.create(template, metadata={"sandpit-bench": sys.argv[3]})
    sbx.commands.run("true")
    samples.append((time.perf_counter() - started) * 1000.0)
    sbx.kill()
print(json.dumps(samples))
