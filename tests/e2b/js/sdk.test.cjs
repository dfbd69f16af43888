// E2B's JavaScript SDK (npm e2b, pinned in package.json), unmodified, against sandpit.
// The Rust test `e2b_sdk` starts the daemon and runs `node --test` on this file with
// E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL pointing at it.
'use strict'

const { test, after } = require('node:test')
const assert = require('node:assert/strict')
const crypto = require('node:crypto')
const { Sandbox, CommandExitError, TimeoutError } = require('e2b')

const made = []
async function fresh(...args) {
  const s = await Sandbox.create(...args)
  made.push(s)
  return s
}
after(async () => {
  for (const s of made) await s.kill().catch(() => {})
})
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

test('create with metadata and env vars', async () => {
  const tag = crypto.randomUUID()
  const s = await fresh({ metadata: { suite: tag }, envs: { GREETING: 'hi from js' } })
  assert.equal((await s.commands.run('echo $GREETING')).stdout, 'hi from js\n')
  const info = await s.getInfo()
  assert.deepEqual(info.metadata, { suite: tag })
  assert.equal(info.state, 'running')
})

test('foreground, cwd, envs, user', async () => {
  const s = await fresh()
  const r = await s.commands.run('echo out; echo err >&2')
  assert.equal(r.stdout, 'out\n')
  assert.equal(r.stderr, 'err\n')
  assert.equal(r.exitCode, 0)
  assert.equal((await s.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await s.commands.run('echo $K', { envs: { K: 'v' } })).stdout, 'v\n')
  assert.equal((await s.commands.run('whoami')).stdout, 'user\n')
  assert.equal((await s.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
})

test('background command reconnected from another client', async () => {
  const s = await fresh()
  const h = await s.commands.run('sleep 1.5; echo finished', { background: true })
  const pid = h.pid
  await h.disconnect()
  const other = await Sandbox.connect(s.sandboxId)
  assert.ok((await other.commands.list()).some((p) => p.pid === pid))
  const r = await (await other.commands.connect(pid)).wait()
  assert.equal(r.stdout, 'finished\n')
})

test('stdin is delivered and closed', async () => {
  const s = await fresh()
  const h = await s.commands.run('cat; echo eof-seen', { background: true, stdin: true })
  await s.commands.sendStdin(h.pid, 'from js\n')
  await s.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'from js\neof-seen\n')
})

test('timeout and non-zero exit raise the SDK errors', async () => {
  const s = await fresh()
  await assert.rejects(s.commands.run('sleep 30', { timeoutMs: 1000 }), TimeoutError)
  await assert.rejects(s.commands.run('echo partial; exit 4'), (e) => {
    assert.ok(e instanceof CommandExitError)
    assert.equal(e.exitCode, 4)
    assert.equal(e.stdout, 'partial\n')
    return true
  })
})

test('pty', async () => {
  const s = await fresh()
  const chunks = []
  const h = await s.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) })
  await s.pty.sendInput(h.pid, new TextEncoder().encode('echo pty-$((6*7)); exit\n'))
  await h.wait()
  assert.match(Buffer.concat(chunks).toString(), /pty-42/)
})

test('files: text, bytes, list with depth, exists, rename, remove, makeDir', async () => {
  const s = await fresh()
  await s.files.write('/home/user/t/hello.txt', 'héllo')
  assert.equal(await s.files.read('/home/user/t/hello.txt'), 'héllo')
  const blob = new Uint8Array(4096).map((_, i) => i % 256)
  await s.files.write('/home/user/t/blob.bin', blob.buffer)
  const got = await s.files.read('/home/user/t/blob.bin', { format: 'bytes' })
  assert.deepEqual(Buffer.from(got), Buffer.from(blob))
  assert.equal(await s.files.makeDir('/home/user/t/a/b'), true)
  await s.files.write('/home/user/t/a/b/deep.txt', 'd')
  const shallow = (await s.files.list('/home/user/t')).map((e) => e.name).sort()
  assert.deepEqual(shallow, ['a', 'blob.bin', 'hello.txt'])
  const deep = (await s.files.list('/home/user/t', { depth: 2 })).map((e) => e.path).sort()
  assert.deepEqual(deep, [
    '/home/user/t/a',
    '/home/user/t/a/b',
    '/home/user/t/blob.bin',
    '/home/user/t/hello.txt',
  ])
  assert.equal(await s.files.exists('/home/user/t/hello.txt'), true)
  assert.equal(await s.files.exists('/home/user/t/none'), false)
  const moved = await s.files.rename('/home/user/t/hello.txt', '/home/user/t/moved.txt')
  assert.equal(moved.path, '/home/user/t/moved.txt')
  await s.files.remove('/home/user/t/a')
  assert.equal(await s.files.exists('/home/user/t/a'), false)
})

test('watchDir reports create and remove', async () => {
  const s = await fresh()
  await s.files.makeDir('/home/user/w')
  const events = []
  const w = await s.files.watchDir('/home/user/w', (e) => events.push(`${e.type}:${e.name}`))
  await s.files.write('/home/user/w/x.txt', 'x')
  await s.commands.run('rm /home/user/w/x.txt')
  for (let i = 0; i < 50 && !events.includes('remove:x.txt'); i++) await sleep(200)
  await w.stop()
  assert.ok(events.includes('create:x.txt'), events.join(','))
  assert.ok(events.includes('remove:x.txt'), events.join(','))
})

test('setTimeout, list with a metadata filter, kill', async () => {
  const tag = crypto.randomUUID()
  const a = await fresh({ metadata: { group: tag } })
  const b = await fresh({ metadata: { group: tag } })
  const before = (await a.getInfo()).endAt
  await a.setTimeout(1_200_000)
  const after = (await a.getInfo()).endAt
  assert.ok(after.getTime() - before.getTime() > 800_000)
  const found = await Sandbox.list({ query: { metadata: { group: tag } } }).nextItems()
  assert.deepEqual(found.map((i) => i.sandboxId).sort(), [a.sandboxId, b.sandboxId].sort())
  assert.equal(await b.kill(), true)
  const left = await Sandbox.list({ query: { metadata: { group: tag } } }).nextItems()
  assert.deepEqual(left.map((i) => i.sandboxId), [a.sandboxId])
})

test('pause then connect keeps files and env', async () => {
  const s = await fresh({ envs: { KEPT: 'js-kept' } })
  await s.files.write('/home/user/state.txt', 'before pause')
  assert.equal(await s.pause(), true)
  assert.equal((await s.getInfo()).state, 'paused')
  const again = await Sandbox.connect(s.sandboxId)
  assert.equal(await again.files.read('/home/user/state.txt'), 'before pause')
  assert.equal((await again.commands.run('echo $KEPT')).stdout, 'js-kept\n')
})

test('snapshot and create from it', async () => {
  const s = await fresh()
  await s.files.write('/home/user/snap.txt', 'snapped')
  const snap = await s.createSnapshot()
  const child = await fresh(snap.snapshotId)
  assert.equal(await child.files.read('/home/user/snap.txt'), 'snapped')
})

test('getHost reaches a server in the sandbox', async () => {
  const s = await fresh()
  await s.files.write('/home/user/site/index.html', 'js sees the sandbox')
  await s.commands.run('cd /home/user/site && python3 -m http.server 8124 --bind 127.0.0.1', {
    background: true,
  })
  const host = s.getHost(8124)
  assert.equal(host, `8124-${s.sandboxId}.${s.sandboxDomain}`)
  const headers = { 'E2b-Sandbox-Id': s.sandboxId, 'E2b-Sandbox-Port': '8124' }
  if (s.trafficAccessToken) headers['E2B-Traffic-Access-Token'] = s.trafficAccessToken
  let body
  for (let i = 0; i < 50; i++) {
    const r = await fetch(process.env.E2B_SANDBOX_URL + '/index.html', { headers })
    if (r.status === 200) {
      body = await r.text()
      break
    }
    await sleep(100)
  }
  assert.equal(body, 'js sees the sandbox')
})

test('volume content: write, read, list, stat, metadata, remove', async () => {
  const { Volume } = require('e2b')
  const vol = await Volume.create(`js-content-${crypto.randomUUID().slice(0, 8)}`)
  try {
    const st = await vol.writeFile('/d/a.txt', 'from js', { force: true })
    assert.equal(st.path, '/d/a.txt')
    assert.equal(st.type, 'file')
    assert.deepEqual([st.uid, st.gid, st.mode, st.size], [1000, 1000, 0o644, 7])
    assert.equal(await vol.readFile('/d/a.txt'), 'from js')
    assert.deepEqual(Buffer.from(await vol.readFile('/d/a.txt', { format: 'bytes' })), Buffer.from('from js'))
    await vol.makeDir('/d/sub', { mode: 0o700 })
    assert.deepEqual((await vol.list('/d')).map((e) => e.path), ['/d/a.txt', '/d/sub'])
    assert.equal((await vol.getInfo('/d/sub')).mode, 0o700)
    const up = await vol.updateMetadata('/d/a.txt', { uid: 0, gid: 0, mode: 0o600 })
    assert.deepEqual([up.uid, up.gid, up.mode], [0, 0, 0o600])
    assert.equal(await vol.exists('/d/a.txt'), true)
    await vol.remove('/d')
    assert.equal(await vol.exists('/d'), false)
    const stranger = new Volume(vol.volumeId, vol.name, 'sp_vol_' + '0'.repeat(64))
    await assert.rejects(stranger.list('/'))
  } finally {
    await Volume.destroy(vol.volumeId)
  }
})
