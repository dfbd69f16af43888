# The Python side of a sandpit code context. The agent starts `python3 -u -c BOOT`, sends
# this file as the first JSON line on fd 3 and then one JSON command per line there; events
# go back as JSON lines on fd 4. Output of the cell (print, subprocesses, C libraries) goes
# to fds 1 and 2 untouched; at the end of a cell the cell's token is written to both, so the
# agent knows it has read all of the cell's output.
#
# Globals defined by BOOT: `_cmd_in` (a binary file object on fd 3).

import ast
import base64
import builtins
import io
import json
import linecache
import os
import signal
import sys
import traceback
import types

_WORKER_FILE = "<sandpit-python-worker>"
_evt_fd = 4
os.set_inheritable(3, False)
os.set_inheritable(4, False)

_state = {"running": False, "count": 0, "loop": None}

# User code runs in a module of its own named __main__, so that pickling, dataclasses and
# `if __name__ == "__main__"` behave as in a script or a notebook.
_main = types.ModuleType("__main__")
_main.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = _main
_ns = _main.__dict__


def _emit(obj):
    data = (json.dumps(obj, default=str) + "\n").encode()
    view = memoryview(data)
    while view:
        n = os.write(_evt_fd, view)
        view = view[n:]


def _on_sigint(signum, frame):
    # Only user code is interrupted: the worker's own bookkeeping (between cells, or
    # while it reports a result) must run to the end, or the protocol would break.
    if _state["running"] and (frame is None or frame.f_code.co_filename != _WORKER_FILE):
        raise KeyboardInterrupt


signal.signal(signal.SIGINT, _on_sigint)

_REPRS = [
    ("_repr_html_", "html"),
    ("_repr_markdown_", "markdown"),
    ("_repr_svg_", "svg"),
    ("_repr_png_", "png"),
    ("_repr_jpeg_", "jpeg"),
    ("_repr_pdf_", "pdf"),
    ("_repr_latex_", "latex"),
    ("_repr_json_", "json"),
    ("_repr_javascript_", "javascript"),
]
_BINARY = {"png", "jpeg", "pdf"}
_MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def _is_figure(obj):
    mpl_figure = sys.modules.get("matplotlib.figure")
    return mpl_figure is not None and isinstance(obj, mpl_figure.Figure)


def _figure_result(fig):
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", bbox_inches="tight")
    except Exception:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    return {"text": repr(fig), "png": base64.b64encode(buf.getvalue()).decode("ascii")}


def _put(out, key, value):
    if value is None:
        return
    if isinstance(value, tuple) and value:
        value = value[0]
    if key in _BINARY:
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(bytes(value)).decode("ascii")
        elif not isinstance(value, str):
            return
    elif key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return
        if not isinstance(value, dict):
            value = {"value": value}
    elif not isinstance(value, str):
        value = str(value)
    out[key] = value


def _format(obj):
    """The result formats of an object, like a notebook's display formatter."""
    if _is_figure(obj):
        return _figure_result(obj)
    out = {}
    if not isinstance(obj, type):
        bundle = None
        try:
            method = getattr(obj, "_repr_mimebundle_", None)
            if callable(method):
                bundle = method()
        except Exception:
            bundle = None
        if isinstance(bundle, tuple) and bundle:
            bundle = bundle[0]
        if isinstance(bundle, dict):
            for mime, key in _MIME.items():
                if mime in bundle:
                    _put(out, key, bundle[mime])
        for attr, key in _REPRS:
            if key in out:
                continue
            try:
                method = getattr(obj, attr, None)
                if callable(method):
                    _put(out, key, method())
            except Exception:
                pass
    if "text" not in out:
        try:
            out["text"] = repr(obj)
        except Exception as e:
            out["text"] = "<repr failed: %s: %s>" % (type(e).__name__, e)
    return out


def display(*objs, **kwargs):
    """Shows objects as extra results of the running cell (like IPython's display)."""
    for obj in objs:
        data = _format(obj)
        data["is_main_result"] = False
        _emit({"ev": "result", "data": data})


builtins.display = display


def _flush_figures(skip):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is skip:
                continue
            data = _figure_result(fig)
            data["is_main_result"] = False
            _emit({"ev": "result", "data": data})
        plt.close("all")
    except Exception as e:
        print("sandpit: could not render matplotlib figures: %s" % e, file=sys.stderr)


def _run(code_obj):
    value = eval(code_obj, _ns)
    if code_obj.co_flags & 0x80:  # CO_COROUTINE: the cell used top-level await
        if _state["loop"] is None:
            import asyncio

            _state["loop"] = asyncio.new_event_loop()
            asyncio.set_event_loop(_state["loop"])
        value = _state["loop"].run_until_complete(value)
    return value


def _user_traceback(e):
    # The worker's own frames (around the cell, or its interrupt handler) are not shown.
    te = traceback.TracebackException(type(e), e, e.__traceback__)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if f.filename != _WORKER_FILE]
    )
    return "".join(te.format())


def _cell(code):
    _state["count"] += 1
    filename = "<cell-%d>" % _state["count"]
    # Tracebacks show the cell's source lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec", flags=flags)
        tail = compile(last, filename, "eval", flags=flags) if last is not None else None
    except SyntaxError as e:
        # Raised by the parser, not by the cell: no frames to show, only the source line.
        raise e.with_traceback(None)
    value = None
    _state["running"] = True
    try:
        _run(body)
        if tail is not None:
            value = _run(tail)
    finally:
        _state["running"] = False
    return tail is not None, value


def _execute(msg):
    env = msg.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    error = None
    value = None
    has_value = False
    _emit({"ev": "start"})
    try:
        has_value, value = _cell(msg["code"])
    except BaseException as e:  # the cell's own error, KeyboardInterrupt and SystemExit too
        error = {"ev": "error", "name": type(e).__name__, "value": str(e), "traceback": _user_traceback(e)}
    finally:
        _state["running"] = False
    if error is None and has_value and value is not None:
        try:
            data = _format(value)
            data["is_main_result"] = True
            _emit({"ev": "result", "data": data})
            _ns["_"] = value
        except Exception as e:
            print("sandpit: could not format the result: %s" % e, file=sys.stderr)
    _flush_figures(value if has_value else None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if error is not None:
        _emit(error)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    token = msg["token"].encode()
    for fd in (1, 2):
        try:
            os.write(fd, token)
        except OSError:
            pass  # the cell closed its own output; the agent stops waiting when the pipe ends
    _emit({"ev": "done", "token": msg["token"], "status": 0 if error is None else 1})


def _main_loop():
    _emit({"ev": "ready"})
    while True:
        line = _cmd_in.readline()
        if not line:
            return
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("op") == "exec":
            _execute(msg)


_main_loop()
