// E2B template builds through the JavaScript SDK (npm e2b, pinned in package.json),
// unmodified, against sandpit. The Rust test `e2b_sdk` runs `node --test` on this file
// with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL pointing at the daemon, whose base
// template is `host` (top level read-only: steps write under /home/user, /opt, /tmp).
'use strict'

const { test } = require('node:test')
const assert = require('node:assert/strict')
const crypto = require('node:crypto')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const { Sandbox, Template, BuildError, waitForFile } = require('e2b')

const unique = (p) => `${p}-${crypto.randomUUID().slice(0, 8)}`
const opts = { cpuCount: 1, memoryMB: 512 }

function contextDir() {
  const d = fs.mkdtempSync(path.join(os.tmpdir(), 'sandpit-e2b-js-'))
  fs.mkdirSync(path.join(d, 'site', 'assets'), { recursive: true })
  fs.writeFileSync(path.join(d, 'site', 'index.html'), '<h1>built</h1>\n')
  fs.writeFileSync(path.join(d, 'site', 'assets', 'app.js'), 'console.log(1)\n')
  fs.writeFileSync(path.join(d, 'run.sh'), '#!/bin/sh\necho js tool\n', { mode: 0o755 })
  fs.symlinkSync('index.html', path.join(d, 'site', 'home.html'))
  return d
}

test('a template built from steps starts sandboxes that show them', async () => {
  const name = unique('js-build')
  const messages = []
  const template = Template({ fileContextPath: contextDir() })
    .fromBaseImage()
    .copy('site', '/home/user/site')
    .copy('run.sh', '/home/user/bin/run.sh')
    .setEnvs({ TOKEN: 'from-env' })
    .runCmd('echo "$TOKEN" > /home/user/token')
    .runCmd('id -un > /opt/js-root', { user: 'root' })
    .makeSymlink('/home/user/site/index.html', '/home/user/index-link')
    .setWorkdir('/home/user/site')
    .setStartCmd('echo up > /tmp/js-started', waitForFile('/tmp/js-started'))
  const info = await Template.build(template, `${name}:v2`, {
    ...opts,
    onBuildLogs: (l) => messages.push(l.message),
  })
  assert.ok(info.templateId && info.buildId)
  assert.ok(messages.some((m) => m.includes('COPY site /home/user/site')), messages.join('\n'))
  assert.equal(await Template.exists(name), true)

  const s = await Sandbox.create(`${name}:v2`, { timeoutMs: 120_000 })
  try {
    const out = async (cmd, o) => (await s.commands.run(cmd, o)).stdout
    assert.equal(await out('cat /home/user/site/index.html'), '<h1>built</h1>\n')
    assert.equal(await out('cat /home/user/site/assets/app.js'), 'console.log(1)\n')
    assert.equal(await out('readlink /home/user/site/home.html'), 'index.html\n')
    assert.equal(await out('/home/user/bin/run.sh'), 'js tool\n')
    assert.equal(await out('cat /home/user/token'), 'from-env\n')
    assert.equal(await out('cat /opt/js-root'), 'root\n')
    assert.equal(await out('readlink /home/user/index-link'), '/home/user/site/index.html\n')
    assert.equal(await out('pwd'), '/home/user/site\n')
    assert.equal(await out('cat /tmp/js-started'), 'up\n')
  } finally {
    await s.kill()
  }

  const tagged = await Template.assignTags(`${name}:v2`, 'latest')
  assert.equal(tagged.buildId, info.buildId)
  const tags = (await Template.getTags(name)).map((t) => t.tag).sort()
  assert.deepEqual(tags, ['latest', 'v2'])
  await Template.removeTags(name, ['latest'])
  assert.deepEqual((await Template.getTags(name)).map((t) => t.tag), ['v2'])
  await assert.rejects(Template.assignTags(`${name}:v2`, ':nope'))
})

test('a background build is followed to ready; registry images and bad steps fail clearly', async () => {
  const name = unique('js-bg')
  const info = await Template.buildInBackground(
    Template().fromTemplate('base').runCmd('sleep 1; echo bg > /home/user/bg'),
    name,
    opts
  )
  let st
  for (let i = 0; i < 400; i++) {
    st = await Template.getBuildStatus(info)
    if (st.status === 'ready' || st.status === 'error') break
    await new Promise((r) => setTimeout(r, 300))
  }
  assert.equal(st.status, 'ready', JSON.stringify(st.reason))
  const s = await Sandbox.create(name, { timeoutMs: 60_000 })
  try {
    assert.equal((await s.commands.run('cat /home/user/bg')).stdout, 'bg\n')
  } finally {
    await s.kill()
  }

  await assert.rejects(
    Template.build(Template().fromImage('ubuntu:22.04'), unique('js-ubuntu'), opts),
    (e) => e instanceof BuildError && /cannot be pulled/.test(e.message) && /e2bdev\/base/.test(e.message)
  )
  await assert.rejects(
    Template.build(Template().fromBaseImage().runCmd('exit 9'), unique('js-fail'), opts),
    (e) => e instanceof BuildError && /exit status 9/.test(e.message)
  )
  assert.equal(await Template.exists(unique('js-missing')), false)
})
