"""E2B's code interpreter SDK (e2b-code-interpreter 2.11.5), unmodified, against sandpit."""

import base64
import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox


@pytest.fixture(scope="module")
def ci():
    s = Sandbox.create(timeout=600)
    yield s
    s.kill()


def test_state_survives_between_calls(ci):
    ci.run_code("x = 41\ndef bump(v):\n    return v + 1")
    ex = ci.run_code("bump(x)")
    assert ex.error is None
    assert ex.text == "42"
    assert ex.results[0].is_main_result is True


def test_stdout_and_stderr_are_collected_in_order(ci):
    ex = ci.run_code("import sys\nprint('one')\nprint('two')\nprint('warn', file=sys.stderr)")
    assert "".join(ex.logs.stdout) == "one\ntwo\n"
    assert "".join(ex.logs.stderr) == "warn\n"
    assert ex.results == []


def test_matplotlib_figure_comes_back_as_png(ci):
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [4, 1, 9])\n"
        "plt.title('sandpit')\n"
        "plt.show()\n"
    )
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 1000


def test_error_has_name_value_and_traceback(ci):
    ex = ci.run_code("print('before')\n1 / 0")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value
    assert "ZeroDivisionError" in ex.error.traceback
    assert "".join(ex.logs.stdout) == "before\n"


def test_streamed_output_reaches_callbacks(ci):
    seen = []
    ci.run_code(
        "import time\nfor i in range(3):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.2)",
        on_stdout=lambda m: seen.append((time.monotonic(), m.line)),
    )
    assert [line for _, line in seen] == ["tick 0\n", "tick 1\n", "tick 2\n"]
    # Streamed while running, not all at the end.
    assert seen[-1][0] - seen[0][0] > 0.25


def test_bash_and_javascript_contexts(ci):
    sh = ci.create_code_context(language="bash")
    ci.run_code("export COLOR=teal; cd /tmp", context=sh)
    ex = ci.run_code("echo $COLOR; pwd", context=sh)
    assert "".join(ex.logs.stdout) == "teal\n/tmp\n"

    js = ci.create_code_context(language="javascript")
    ci.run_code("let counter = 40;", context=js)
    ex = ci.run_code("counter += 2; counter", context=js)
    assert ex.error is None, ex.error
    assert ex.text == "42"


def test_contexts_list_restart_and_remove(ci):
    ctx = ci.create_code_context(language="python", cwd="/tmp")
    ci.run_code("import os\nsecret = 7", context=ctx)
    assert ci.run_code("os.getcwd()", context=ctx).text == "'/tmp'"
    ids = [c.id for c in ci.list_code_contexts()]
    assert ctx.id in ids
    ci.restart_code_context(ctx)
    ex = ci.run_code("secret", context=ctx)
    assert ex.error is not None and ex.error.name == "NameError"
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]


def test_a_timeout_interrupts_and_the_context_lives_on(ci):
    ctx = ci.create_code_context(language="python")
    ci.run_code("kept = 'yes'", context=ctx)
    with pytest.raises(TimeoutException):
        ci.run_code("while True:\n    pass", context=ctx, timeout=2)
    ex = None
    for _ in range(50):
        ex = ci.run_code("kept", context=ctx)
        if ex.error is None:
            break
        time.sleep(0.2)
    assert ex is not None and ex.text == "'yes'"
