// The JavaScript side of a sandpit code context. The agent starts `node -e BOOT`, sends
// this file as the first JSON line on fd 3 and then one JSON command per line there;
// events go back as JSON lines on fd 4. Cells run in this process's global scope, so
// variables, functions and required modules survive from one cell to the next. Output of
// the cell goes to fds 1 and 2; at the end of a cell its token is written to both.
(function () {
  'use strict';
  const fs = require('fs');
  const net = require('net');
  const readline = require('readline');
  const util = require('util');
  const vm = require('vm');

  let count = 0;
  let interruptCell = null;

  function emit(obj) {
    const data = Buffer.from(JSON.stringify(obj) + '\n');
    let off = 0;
    while (off < data.length) off += fs.writeSync(4, data, off);
  }

  // Between cells an interrupt does nothing; while a cell awaits a promise it ends the
  // wait (synchronous code is stopped by breakOnSigint instead).
  process.on('SIGINT', () => {
    if (interruptCell) interruptCell();
  });
  // A failing callback left behind by an earlier cell must not take the context down.
  process.on('uncaughtException', (e) => {
    process.stderr.write('Uncaught ' + util.inspect(e) + '\n');
  });
  process.on('unhandledRejection', (e) => {
    process.stderr.write('Unhandled rejection ' + util.inspect(e) + '\n');
  });

  // Stack lines of the worker and of node's vm plumbing are not the user's.
  function userStack(stack) {
    return String(stack)
      .split('\n')
      .filter((l) => !/<sandpit-node-worker>|\(node:|at node:|sigintHandlersWrap/.test(l))
      .join('\n');
  }

  function describe(e) {
    if (e instanceof Error || (e && typeof e === 'object' && 'message' in e)) {
      return {
        name: String(e.name || 'Error'),
        value: String(e.message),
        traceback: userStack(e.stack || e.message),
      };
    }
    const text = util.inspect(e);
    return { name: 'Error', value: text, traceback: 'Uncaught ' + text };
  }

  function compile(code, filename) {
    try {
      return new vm.Script(code, { filename });
    } catch (e) {
      if (!(e instanceof SyntaxError && /await/.test(e.message))) throw e;
    }
    // Top-level await: run the cell in an async function. A single expression keeps its
    // value; other cells' declarations then stay local to the cell.
    try {
      return new vm.Script('(async () => (\n' + code + '\n))()', { filename, lineOffset: -1 });
    } catch (e) {
      return new vm.Script('(async () => {\n' + code + '\n})()', { filename, lineOffset: -1 });
    }
  }

  async function execute(msg) {
    const env = msg.env || {};
    const saved = {};
    for (const k of Object.keys(env)) {
      saved[k] = Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined;
      process.env[k] = env[k];
    }
    count += 1;
    let error = null;
    let value;
    emit({ ev: 'start' });
    try {
      const script = compile(msg.code, 'cell-' + count + '.js');
      value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
      if (value && typeof value.then === 'function') {
        const pending = value;
        value = await new Promise((resolve, reject) => {
          interruptCell = () => {
            const e = new Error('Execution was interrupted while awaiting a promise');
            e.name = 'Interrupted';
            reject(e);
          };
          pending.then(resolve, reject);
        });
      }
    } catch (e) {
      error = describe(e);
      if (e && e.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') error.name = 'Interrupted';
    } finally {
      interruptCell = null;
    }
    if (error === null && value !== undefined) {
      let text;
      try {
        text = util.inspect(value);
      } catch (e) {
        text = '<inspect failed: ' + e + '>';
      }
      emit({ ev: 'result', data: { text, is_main_result: true } });
      globalThis._ = value;
    }
    for (const k of Object.keys(saved)) {
      if (saved[k] === undefined) delete process.env[k];
      else process.env[k] = saved[k];
    }
    if (error !== null) emit(Object.assign({ ev: 'error' }, error));
    for (const fd of [1, 2]) {
      try {
        fs.writeSync(fd, msg.token);
      } catch (e) {
        // The cell closed its own output; the agent stops waiting when the pipe ends.
      }
    }
    emit({ ev: 'done', token: msg.token, status: error === null ? 0 : 1 });
  }

  const input = new net.Socket({ fd: 3, readable: true, writable: false });
  const lines = readline.createInterface({ input, crlfDelay: Infinity });
  let queue = Promise.resolve();
  lines.on('line', (line) => {
    let msg;
    try {
      msg = JSON.parse(line);
    } catch (e) {
      return;
    }
    if (msg && msg.op === 'exec') queue = queue.then(() => execute(msg));
  });
  lines.on('close', () => process.exit(0));
  emit({ ev: 'ready' });
})();
