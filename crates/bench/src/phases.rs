//! The latency and throughput measurements: cold and pooled start, many starts at once,
//! sustained churn, exec round trip and file transfer.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use futures::StreamExt;
use sandpit_api::{LimitsSpec, PoolSpec};

use super::report::Report;
use super::{Bench, COLD_LIMITS, MIB, Progress, TempDir, ms};

/// Size of the file written into and read back from a sandbox.
const FILE_BYTES: u64 = 100 << 20;
/// Where that file goes inside the sandbox (the writable layer).
const FILE_PATH: &str = "/tmp/sandpit-bench.bin";
/// Runs of `true` before the exec round trip is timed (connection set-up, agent caches).
const EXEC_WARMUP: usize = 3;
/// How long the pool may take to fill (to its size at the start, to one sandbox between
/// claims) before the phase gives up.
const POOL_FILL_TIMEOUT: Duration = Duration::from_secs(120);
/// Deletes in flight at once when many sandboxes go.
const DELETE_PARALLEL: usize = 16;
/// The sustained phase stops early after this many failed creates or deletes.
const SUSTAINED_MAX_ERRORS: usize = 50;

impl Bench {
    /// `cold_first_exec` and `delete`: one sandbox after another, no pool to help.
    pub(super) async fn cold(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("cold_first_exec");
        report.declare_dist("delete");
        let req = self.api.request(COLD_LIMITS);
        let progress = Progress::new("cold create -> first exec", self.iterations);
        let mut create = Vec::with_capacity(self.iterations);
        let mut delete = Vec::with_capacity(self.iterations);
        // One round first, untimed: the first sandbox after a daemon start pays for cold
        // caches (template skeleton, page cache of the binary) that no later one sees.
        for i in 0..=self.iterations {
            self.api.cancel.check()?;
            let (sb, started, ran) = self.api.create_first_exec(&req).await?;
            let t = Instant::now();
            let deleted = self.api.delete(&sb.id).await;
            let stopped = t.elapsed();
            ran?;
            deleted?;
            if i > 0 {
                create.push(ms(started));
                delete.push(ms(stopped));
            }
            progress.set(i);
        }
        report.set_dist("cold_first_exec", Ok(create));
        report.set_dist("delete", Ok(delete));
        report.note(
            "cold_first_exec",
            "create -> first `true` done, one at a time, with max_processes 511 so that no warm \
             pool matches",
        );
        Ok(())
    }

    /// `pool_first_exec`: claim a ready sandbox of a warm pool, run `true`, delete it; the
    /// pool refills between claims, untimed.
    pub(super) async fn pool(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("pool_first_exec");
        report.set("pool.hits", None);
        report.set("pool.misses", None);
        let client = &self.api.client;
        let spec = PoolSpec {
            name: self.pool_name.clone(),
            template: Some("host".into()),
            runtime: Some("container".into()),
            limits: LimitsSpec::default(),
            size: self.pool_size,
        };
        // Set before asking, so that a create cut short still gets its delete.
        self.pool_created
            .store(true, std::sync::atomic::Ordering::SeqCst);
        match client.create_pool(&spec).await {
            Ok(_) => {}
            Err(e) if matches!(e.status(), Some(404 | 405)) => {
                self.pool_created
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                eprintln!("note: pool: not supported by this daemon");
                report.note("pool_first_exec", "pool: not supported by this daemon");
                return Ok(());
            }
            Err(e) => return Err(anyhow!("create pool {}: {e}", self.pool_name)),
        }
        self.wait_pool_ready(self.pool_size).await?;

        let req = self.api.request(LimitsSpec::default());
        let progress = Progress::new("pool claim -> first exec", self.iterations);
        let (mut samples, mut hits, mut misses) = (Vec::new(), 0u64, 0u64);
        for i in 0..self.iterations {
            self.api.cancel.check()?;
            self.wait_pool_ready(1).await?;
            let (sb, started, ran) = self.api.create_first_exec(&req).await?;
            let deleted = self.api.delete(&sb.id).await;
            ran?;
            deleted?;
            if sb.pool.as_deref() == Some(self.pool_name.as_str()) {
                hits += 1;
                samples.push(ms(started));
            } else {
                // A cold start, which would blur the figure: counted, not timed.
                misses += 1;
            }
            progress.set(i + 1);
        }
        report.set("pool.hits", Some(hits as f64));
        report.set("pool.misses", Some(misses as f64));
        report.set_dist("pool_first_exec", Ok(samples));
        report.note(
            "pool_first_exec",
            format!(
                "create (claim from the pool {}, size {}) -> first `true` done, waiting for a \
                 ready sandbox before each claim; misses (sandboxes not from the pool) are not \
                 timed",
                self.pool_name, self.pool_size
            ),
        );
        Ok(())
    }

    /// Polls the pool until it has `want` ready sandboxes.
    async fn wait_pool_ready(&self, want: u32) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            self.api.cancel.check()?;
            let pool = self
                .api
                .client
                .get_pool(&self.pool_name)
                .await
                .with_context(|| format!("get pool {}", self.pool_name))?;
            if pool.ready >= want {
                return Ok(());
            }
            if start.elapsed() > POOL_FILL_TIMEOUT {
                bail!(
                    "pool {} has {} of {want} sandboxes ready after {} s ({} starting)",
                    self.pool_name,
                    pool.ready,
                    POOL_FILL_TIMEOUT.as_secs(),
                    pool.starting
                );
            }
            // Frequent enough to claim soon after a refill, rare enough not to load the
            // daemon that is doing it.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `exec_rtt`: `true` again and again in one running sandbox; `daemon_get`: the same
    /// sandbox's record, which costs the daemon authentication and a store read only.
    pub(super) async fn exec_rtt(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("exec_rtt");
        report.declare_dist("daemon_get");
        let sb = self.api.create(&self.api.request(COLD_LIMITS)).await?;
        let id = sb.id;
        let result = async {
            for _ in 0..EXEC_WARMUP {
                self.api.run_true(&id).await?;
            }
            let progress = Progress::new("exec round trip", self.iterations);
            let mut exec = Vec::with_capacity(self.iterations);
            for i in 0..self.iterations {
                self.api.cancel.check()?;
                let t = Instant::now();
                self.api.run_true(&id).await?;
                exec.push(ms(t.elapsed()));
                progress.set(i + 1);
            }
            drop(progress);
            let progress = Progress::new("daemon GET", self.iterations);
            let mut get = Vec::with_capacity(self.iterations);
            for i in 0..self.iterations {
                self.api.cancel.check()?;
                let t = Instant::now();
                self.api
                    .client
                    .get_sandbox(&id)
                    .await
                    .with_context(|| format!("get sandbox {id}"))?;
                get.push(ms(t.elapsed()));
                progress.set(i + 1);
            }
            anyhow::Ok((exec, get))
        }
        .await;
        let deleted = self.api.delete(&id).await;
        let (exec, get) = result?;
        report.set_dist("exec_rtt", Ok(exec));
        report.set_dist("daemon_get", Ok(get));
        deleted
    }

    /// `concurrent_first_exec`: N cold creates released at the same moment, each timed to
    /// the end of its first `true`.
    pub(super) async fn concurrent(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("concurrent_first_exec");
        report.set("concurrent.wall_ms", None);
        report.set("concurrent.failed", None);
        let n = self.concurrency;
        if n == 0 {
            report.note("concurrent_first_exec", "skipped (--concurrency 0)");
            return Ok(());
        }
        let req = Arc::new(self.api.request(COLD_LIMITS));
        let barrier = Arc::new(tokio::sync::Barrier::new(n));
        let mut tasks = Vec::with_capacity(n);
        eprintln!("{n} concurrent creates ...");
        for _ in 0..n {
            let (api, req, barrier) = (self.api.clone(), req.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let t0 = Instant::now();
                let r = api.create_first_exec(&req).await;
                (t0, Instant::now(), r)
            }));
        }
        let (mut samples, mut ids, mut errors) = (Vec::new(), Vec::new(), Vec::new());
        let (mut first, mut last) = (None::<Instant>, None::<Instant>);
        for task in tasks {
            match task.await {
                Ok((t0, t1, Ok((sb, took, ran)))) => {
                    ids.push(sb.id);
                    match ran {
                        Ok(()) => samples.push(ms(took)),
                        Err(e) => errors.push(format!("{e:#}")),
                    }
                    first = Some(first.map_or(t0, |f| f.min(t0)));
                    last = Some(last.map_or(t1, |l| l.max(t1)));
                }
                Ok((_, _, Err(e))) => errors.push(format!("{e:#}")),
                Err(e) => errors.push(format!("task: {e}")),
            }
        }
        let deleted = self.api.delete_all(&ids, DELETE_PARALLEL, "deleting").await;
        self.api.cancel.check()?;
        report.set("concurrent.failed", Some(errors.len() as f64));
        if let (Some(f), Some(l)) = (first, last) {
            report.set("concurrent.wall_ms", Some(ms(l - f)));
        }
        if let Some(e) = errors.first() {
            report.note(
                "concurrent.failed",
                format!("{} of {n} failed; first: {e}", errors.len()),
            );
        }
        report.set_dist("concurrent_first_exec", Ok(samples));
        deleted
    }

    /// `sustained.*`: workers creating and deleting cold sandboxes in a loop for a while.
    pub(super) async fn sustained(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("sustained_create");
        report.declare_dist("sustained_delete");
        report.set("sustained.cycles_per_s", None);
        report.set("sustained.errors", None);
        let req = Arc::new(self.api.request(COLD_LIMITS));
        let deadline = Instant::now() + self.sustained;
        let errors = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        eprintln!(
            "sustained creates and deletes: {} workers for {} s ...",
            self.workers,
            self.sustained.as_secs()
        );
        let start = Instant::now();
        let mut tasks = Vec::with_capacity(self.workers);
        for _ in 0..self.workers {
            let (api, req, errors) = (self.api.clone(), req.clone(), errors.clone());
            tasks.push(tokio::spawn(async move {
                let (mut creates, mut deletes, mut first_err) = (Vec::new(), Vec::new(), None);
                let fail = |e: anyhow::Error, first: &mut Option<String>| {
                    errors.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    first.get_or_insert_with(|| format!("{e:#}"));
                };
                while Instant::now() < deadline
                    && !api.cancel.is_set()
                    && errors.load(std::sync::atomic::Ordering::SeqCst) < SUSTAINED_MAX_ERRORS
                {
                    let t = Instant::now();
                    let sb = match api.create(&req).await {
                        Ok(sb) => sb,
                        Err(e) => {
                            fail(e, &mut first_err);
                            continue;
                        }
                    };
                    creates.push(ms(t.elapsed()));
                    let t = Instant::now();
                    match api.delete(&sb.id).await {
                        Ok(()) => deletes.push(ms(t.elapsed())),
                        // Left in the tracker for the cleanup.
                        Err(e) => fail(e, &mut first_err),
                    }
                }
                (creates, deletes, first_err)
            }));
        }
        let (mut creates, mut deletes, mut first_err) = (Vec::new(), Vec::new(), None);
        for task in tasks {
            match task.await {
                Ok((c, d, e)) => {
                    creates.extend(c);
                    deletes.extend(d);
                    first_err = first_err.or(e);
                }
                Err(e) => first_err = first_err.or(Some(format!("task: {e}"))),
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        self.api.cancel.check()?;
        let errors = errors.load(std::sync::atomic::Ordering::SeqCst);
        report.set("sustained.errors", Some(errors as f64));
        if elapsed > 0.0 {
            report.set(
                "sustained.cycles_per_s",
                Some(deletes.len() as f64 / elapsed),
            );
        }
        report.note(
            "sustained.cycles_per_s",
            format!(
                "completed create+delete pairs per second over {elapsed:.1} s ({} creates, {} \
                 deletes); the crun figure beside it is N concurrent `crun run`s divided by \
                 their wall time",
                creates.len(),
                deletes.len()
            ),
        );
        if let Some(e) = first_err {
            report.note("sustained.errors", format!("first: {e}"));
        }
        report.set_dist("sustained_create", Ok(creates));
        report.set_dist("sustained_delete", Ok(deletes));
        Ok(())
    }

    /// `file_write.mb_per_s` and `file_read.mb_per_s`: 100 MiB up, then down again.
    pub(super) async fn file_io(&self, report: &mut Report) -> anyhow::Result<()> {
        report.set("file_write.mb_per_s", None);
        report.set("file_read.mb_per_s", None);
        let dir = TempDir::new("file")?;
        let local = dir.path().join("payload.bin");
        {
            let local = local.clone();
            tokio::task::spawn_blocking(move || write_payload(&local, FILE_BYTES))
                .await
                .context("the payload thread failed")??;
        }
        self.api.cancel.check()?;
        // The writable layer is a tmpfs charged to memory: room for the file twice over.
        let limits = LimitsSpec {
            memory_bytes: Some(1 << 30),
            disk_bytes: Some(512 << 20),
            ..Default::default()
        };
        let id = self.api.create(&self.api.request(limits)).await?.id;
        let client = &self.api.client;
        let result = async {
            let t = Instant::now();
            client
                .upload_from_file(&id, FILE_PATH, &local)
                .await
                .context("upload")?;
            let write_s = t.elapsed().as_secs_f64();
            let size = client.stat(&id, FILE_PATH).await.context("stat")?.size;
            if u64::try_from(size).ok() != Some(FILE_BYTES) {
                bail!("the uploaded file has {size} bytes, not {FILE_BYTES}");
            }
            self.api.cancel.check()?;

            let t = Instant::now();
            let stream = client
                .download_stream(&id, FILE_PATH)
                .await
                .context("download")?;
            let mut stream = std::pin::pin!(stream);
            let mut got = 0u64;
            while let Some(chunk) = stream.next().await {
                got += chunk.context("download")?.len() as u64;
            }
            let read_s = t.elapsed().as_secs_f64();
            if got != FILE_BYTES {
                bail!("downloaded {got} bytes, not {FILE_BYTES}");
            }
            anyhow::Ok((write_s, read_s))
        }
        .await;
        let deleted = self.api.delete(&id).await;
        let (write_s, read_s) = result?;
        let mib = FILE_BYTES as f64 / MIB;
        report.set("file_write.mb_per_s", Some(mib / write_s));
        report.set("file_read.mb_per_s", Some(mib / read_s));
        deleted
    }
}

/// Writes `len` bytes of pseudo-random data (incompressible, so no layer can cheat).
pub(super) fn write_payload(path: &Path, len: u64) -> anyhow::Result<()> {
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
    );
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut chunk = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for word in chunk.chunks_exact_mut(8) {
            // xorshift64: fast, and good enough to defeat compression.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])
            .with_context(|| format!("write {}", path.display()))?;
        left -= n as u64;
    }
    file.flush()
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}
