//! The figures of a run under stable dotted names, and their two renderings: the table for
//! people and the JSON document for tools.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Value, json};

/// p50, p95 and p99 of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Dist {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// The `q` quantile (0..=1) of sorted samples, interpolating linearly between the closest
/// ranks; None for no samples.
pub(super) fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = q.clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

impl Dist {
    pub(super) fn of(samples: &[f64]) -> Option<Dist> {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Dist {
            p50: quantile(&sorted, 0.50)?,
            p95: quantile(&sorted, 0.95)?,
            p99: quantile(&sorted, 0.99)?,
        })
    }
}

/// Which way a target points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Goal {
    AtMost,
    AtLeast,
}

/// Whether a line of SPECIFICATION.md is held today or aimed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Promise,
    Target,
}

/// One line of SPECIFICATION.md's table: a figure, which way it must point and how far.
/// `*` in a key stands for a number (of idle sandboxes). Informational: printed beside the figure, never asserted.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Target {
    pub key: String,
    pub value: f64,
    pub goal: Goal,
    pub unit: String,
    pub kind: Kind,
}

/// The promises, included at build time so that there is no second copy of them in code.
const SPECIFICATION: &str = include_str!("../../../SPECIFICATION.md");

/// Parses the rows between the `figures:begin` and `figures:end` markers.
pub(super) fn parse_targets(spec: &str) -> Result<Vec<Target>, String> {
    let begin = spec
        .find("<!-- figures:begin")
        .ok_or("no figures:begin marker")?;
    let end = spec
        .find("<!-- figures:end")
        .ok_or("no figures:end marker")?;
    let mut out = Vec::new();
    for line in spec[begin..end].lines().skip(1) {
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells.len() < 5 || cells[0] == "figure" || cells[0].starts_with("---") {
            continue;
        }
        let bad = |what: &str| format!("{what} in the SPECIFICATION.md row {line:?}");
        let goal = match cells[1] {
            "<=" => Goal::AtMost,
            ">=" => Goal::AtLeast,
            _ => return Err(bad("a goal other than <= or >=")),
        };
        let kind = match cells[4] {
            "promise" => Kind::Promise,
            "target" => Kind::Target,
            _ => return Err(bad("a kind other than promise or target")),
        };
        out.push(Target {
            key: cells[0].trim_matches('`').to_string(),
            value: cells[2]
                .parse()
                .map_err(|_| bad("a value that is no number"))?,
            goal,
            unit: cells[3].to_string(),
            kind,
        });
    }
    if out.is_empty() {
        return Err("no figures between the markers".into());
    }
    Ok(out)
}

/// SPECIFICATION.md's lines (a unit test keeps the file parseable).
pub(super) fn targets() -> &'static [Target] {
    static PARSED: std::sync::OnceLock<Vec<Target>> = std::sync::OnceLock::new();
    PARSED.get_or_init(|| parse_targets(SPECIFICATION).unwrap_or_default())
}

/// Whether `key` matches `pattern`, whose `*` stands for a number (of idle sandboxes).
fn key_matches(pattern: &str, key: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == key,
        Some((head, tail)) => {
            let Some(rest) = key.strip_prefix(head) else {
                return false;
            };
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            digits > 0 && key_matches(tail, &rest[digits..])
        }
    }
}

/// The lines of a figure (a promise, a target, or both).
pub(super) fn targets_of(key: &str) -> impl Iterator<Item = &'static Target> + '_ {
    targets().iter().filter(move |t| key_matches(&t.key, key))
}

/// The target line of a figure, if it has one.
#[cfg(test)]
pub(super) fn target_of(key: &str) -> Option<&'static Target> {
    targets_of(key).find(|t| t.kind == Kind::Target)
}

/// Figures under stable dotted names (null when not measured), why some are missing, and
/// the latency samples behind the distributions (for the chart).
#[derive(Debug, Default)]
pub(super) struct Report {
    pub figures: BTreeMap<String, Option<f64>>,
    pub notes: BTreeMap<String, String>,
    pub samples: BTreeMap<String, Vec<f64>>,
    /// Pid of the daemon, when it runs on this machine.
    pub daemon_pid: Option<i32>,
}

/// What the run was asked to do, for the headings.
#[derive(Debug, Clone)]
pub(super) struct Header {
    pub url: String,
    pub daemon_version: String,
    pub started: String,
    pub iterations: u32,
    pub concurrency: u32,
    pub workers: u32,
    pub sustained_secs: u64,
    pub idle: Vec<u32>,
    pub phases: Vec<String>,
}

impl Report {
    pub(super) fn set(&mut self, key: &str, value: Option<f64>) {
        self.figures.insert(key.to_string(), value);
    }

    pub(super) fn get(&self, key: &str) -> Option<f64> {
        self.figures.get(key).copied().flatten()
    }

    pub(super) fn note(&mut self, key: &str, text: impl Into<String>) {
        self.notes.insert(key.to_string(), text.into());
    }

    /// Declares the names of a distribution (null until measured).
    pub(super) fn declare_dist(&mut self, prefix: &str) {
        for q in ["p50", "p95", "p99"] {
            self.figures.entry(format!("{prefix}.{q}_ms")).or_default();
        }
    }

    /// `<prefix>.p50_ms`, `.p95_ms` and `.p99_ms`, or nulls and a note saying why.
    pub(super) fn set_dist(&mut self, prefix: &str, samples: Result<Vec<f64>, String>) {
        self.declare_dist(prefix);
        let samples = samples.and_then(|s| match Dist::of(&s) {
            Some(d) => Ok((s, d)),
            None => Err("no samples (0 iterations)".to_string()),
        });
        match samples {
            Ok((s, d)) => {
                self.set(&format!("{prefix}.p50_ms"), Some(d.p50));
                self.set(&format!("{prefix}.p95_ms"), Some(d.p95));
                self.set(&format!("{prefix}.p99_ms"), Some(d.p99));
                self.samples.insert(prefix.to_string(), s);
            }
            Err(reason) => self.note(prefix, reason),
        }
    }

    /// `ratio.<name>` = a / b when both are known.
    pub(super) fn set_ratio(&mut self, name: &str, a: &str, b: &str) {
        let ratio = match (self.get(a), self.get(b)) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        self.set(&format!("ratio.{name}"), ratio);
    }

    pub(super) fn to_json(&self, h: &Header) -> Value {
        // Three decimals are far below the noise of any of these figures.
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let figures: serde_json::Map<String, Value> = self
            .figures
            .iter()
            .map(|(k, v)| (k.clone(), v.map(round).map_or(Value::Null, Value::from)))
            .collect();
        let line = |t: &Target| {
            let goal = match t.goal {
                Goal::AtMost => "at_most",
                Goal::AtLeast => "at_least",
            };
            (t.key.clone(), json!({ goal: t.value }))
        };
        let of_kind = |k: Kind| -> serde_json::Map<String, Value> {
            targets().iter().filter(|t| t.kind == k).map(line).collect()
        };
        let (promises, targets) = (of_kind(Kind::Promise), of_kind(Kind::Target));
        let samples: serde_json::Map<String, Value> = self
            .samples
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|x| round(*x)).collect()))
            .collect();
        json!({
            "sandpit_version": env!("CARGO_PKG_VERSION"),
            "daemon_version": h.daemon_version,
            "url": h.url,
            "started": h.started,
            "daemon_pid": self.daemon_pid,
            "phases": h.phases,
            "iterations": h.iterations,
            "concurrency": h.concurrency,
            "sustained_workers": h.workers,
            "sustained_secs": h.sustained_secs,
            "idle": h.idle,
            "units": "ms = milliseconds, MB = MiB (2^20 bytes), mb_per_s = MiB per second, s = seconds, per_s = per second",
            "figures": figures,
            "promises": promises,
            "targets": targets,
            "notes": self.notes,
            "samples_ms": samples,
        })
    }

    fn fmt(&self, key: &str) -> String {
        let Some(v) = self.get(key) else {
            return if self.figures.contains_key(key) {
                "n/a".to_string()
            } else {
                String::new()
            };
        };
        let unit = if key.ends_with("_ms") {
            " ms"
        } else if key.ends_with("_mb") {
            " MB"
        } else if key.ends_with("mb_per_s") {
            " MB/s"
        } else if key.ends_with("per_s") {
            " /s"
        } else if key.ends_with("_s") {
            " s"
        } else {
            ""
        };
        if unit.is_empty() && v.fract() == 0.0 {
            format!("{v:.0}")
        } else if (unit == " ms" || unit == " MB") && v.abs() < 10.0 {
            format!("{v:.2}{unit}")
        } else {
            format!("{v:.1}{unit}")
        }
    }

    fn ratio(&self, key: &str) -> String {
        match self.get(key) {
            Some(r) if r >= 10.0 => format!("{r:.0}x"),
            Some(r) => format!("{r:.2}x"),
            None if key.is_empty() => String::new(),
            None => "n/a".to_string(),
        }
    }

    /// "p50 <= 2 ms (met)" for each line of SPECIFICATION.md that `keys` have; a promise
    /// is marked as such, a target is not.
    fn targets(&self, keys: &[&str]) -> String {
        let mut out = Vec::new();
        for key in keys.iter().filter(|k| !k.is_empty()) {
            for t in targets_of(key) {
                let what = if key.starts_with("ratio.") {
                    "ratio"
                } else {
                    key.rsplit('.')
                        .next()
                        .map(|l| l.trim_end_matches("_ms").trim_end_matches("_mb"))
                        .unwrap_or_default()
                };
                let (op, met) = match t.goal {
                    Goal::AtMost => ("<=", self.get(key).map(|v| v <= t.value)),
                    Goal::AtLeast => (">=", self.get(key).map(|v| v >= t.value)),
                };
                let unreliable = self
                    .notes
                    .get(*key)
                    .is_some_and(|n| n.contains("UNRELIABLE"));
                let verdict = match self.get(key) {
                    Some(_) if unreliable => "unreliable",
                    _ => match met {
                        Some(true) => "met",
                        Some(false) => "missed",
                        None => "n/a",
                    },
                };
                let kind = if t.kind == Kind::Promise {
                    "promise "
                } else {
                    ""
                };
                out.push(format!(
                    "{kind}{what} {op} {} {} ({verdict})",
                    t.value, t.unit
                ));
            }
        }
        out.join(", ")
    }

    pub(super) fn to_table(&self, h: &Header) -> String {
        let mut out = String::new();
        let pid = self
            .daemon_pid
            .map_or_else(|| "not on this machine".to_string(), |p| format!("pid {p}"));
        let _ = writeln!(
            out,
            "sandpit bench {}: daemon {} (version {}, {pid}); phases {}",
            h.started,
            h.url,
            h.daemon_version,
            h.phases.join(",")
        );
        let _ = writeln!(
            out,
            "{} iterations, {} concurrent creates, {} workers for {} s, idle {}; \
             MB = MiB; latencies are wall-clock as the client sees them; targets are informational",
            h.iterations,
            h.concurrency,
            h.workers,
            h.sustained_secs,
            h.idle
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
        let _ = writeln!(out);
        let mut t = Table::default();
        t.row([
            "sandpit", "p50", "p95", "p99", "baseline", "ratio", "target",
        ]);

        // A latency row: the distribution, a baseline and its ratio, and the targets.
        let dist_row = |t: &mut Table, label: &str, prefix: &str, base: (&str, &str, &str)| {
            let (p50, p95, p99) = (
                format!("{prefix}.p50_ms"),
                format!("{prefix}.p95_ms"),
                format!("{prefix}.p99_ms"),
            );
            if !self.figures.contains_key(&p50) {
                return;
            }
            // No baseline column for a baseline this run did not measure.
            let (blabel, bkey, rkey) = if self.figures.contains_key(base.1) {
                base
            } else {
                ("", "", "")
            };
            let baseline = if bkey.is_empty() {
                String::new()
            } else {
                format!("{blabel} {}", self.fmt(bkey))
            };
            t.row([
                label,
                &self.fmt(&p50),
                &self.fmt(&p95),
                &self.fmt(&p99),
                &baseline,
                &self.ratio(rkey),
                &self.targets(&[&p50, &p95, rkey]),
            ]);
        };
        // A further baseline under the row above.
        let base_row = |t: &mut Table, blabel: &str, bkey: &str, rkey: &str| {
            if self.figures.contains_key(bkey) && self.figures.contains_key(rkey) {
                t.row([
                    "",
                    "",
                    "",
                    "",
                    &format!("{blabel} {}", self.fmt(bkey)),
                    &self.ratio(rkey),
                    &self.targets(&[rkey]),
                ]);
            }
        };
        // A single figure in the p50 column.
        let value_row = |t: &mut Table, label: &str, key: &str, base: (&str, &str, &str)| {
            if !self.figures.contains_key(key) {
                return;
            }
            // No baseline column for a baseline this run did not measure.
            let (blabel, bkey, rkey) = if self.figures.contains_key(base.1) {
                base
            } else {
                ("", "", "")
            };
            let baseline = if bkey.is_empty() {
                String::new()
            } else {
                format!("{blabel} {}", self.fmt(bkey))
            };
            t.row([
                label,
                &self.fmt(key),
                "",
                "",
                &baseline,
                &self.ratio(rkey),
                &self.targets(&[key, rkey]),
            ]);
        };
        let none = ("", "", "");

        dist_row(
            &mut t,
            "pool claim -> first exec",
            "pool_first_exec",
            (
                "crun run",
                "baseline.crun_run.p50_ms",
                "ratio.pool_vs_crun_run",
            ),
        );
        base_row(
            &mut t,
            "fork+exec",
            "baseline.fork_exec.p50_ms",
            "ratio.pool_vs_fork_exec",
        );
        // Counts of a pool phase that did not run would only repeat its n/a.
        if self.get("pool.hits").is_some() {
            value_row(&mut t, "  claims served by the pool", "pool.hits", none);
            value_row(&mut t, "  cold misses (not timed)", "pool.misses", none);
        }
        dist_row(
            &mut t,
            "cold create -> first exec",
            "cold_first_exec",
            (
                "crun run",
                "baseline.crun_run.p50_ms",
                "ratio.cold_vs_crun_run",
            ),
        );
        base_row(
            &mut t,
            "crun run net",
            "baseline.crun_run_net.p50_ms",
            "ratio.cold_vs_crun_run_net",
        );
        base_row(
            &mut t,
            "unshare",
            "baseline.unshare.p50_ms",
            "ratio.cold_vs_unshare",
        );
        base_row(
            &mut t,
            "bwrap",
            "baseline.bwrap.p50_ms",
            "ratio.cold_vs_bwrap",
        );
        base_row(
            &mut t,
            "runsc",
            "baseline.runsc_ptrace.p50_ms",
            "ratio.cold_vs_runsc_ptrace",
        );
        dist_row(&mut t, "  delete", "delete", none);
        dist_row(
            &mut t,
            &format!("{} concurrent creates -> exec", h.concurrency),
            "concurrent_first_exec",
            (
                "crun run p95",
                "baseline.crun_run_concurrent.p95_ms",
                "ratio.concurrent_vs_crun_run_concurrent",
            ),
        );
        value_row(
            &mut t,
            "  wall time for all",
            "concurrent.wall_ms",
            (
                "crun",
                "baseline.crun_run_concurrent.wall_ms",
                "ratio.concurrent_wall_vs_crun",
            ),
        );
        value_row(&mut t, "  failed", "concurrent.failed", none);
        value_row(
            &mut t,
            &format!("sustained ({} workers)", h.workers),
            "sustained.cycles_per_s",
            (
                "crun runs",
                "baseline.crun_run_concurrent.per_s",
                "ratio.sustained_vs_crun",
            ),
        );
        dist_row(&mut t, "  create", "sustained_create", none);
        dist_row(&mut t, "  delete", "sustained_delete", none);
        value_row(&mut t, "  failed", "sustained.errors", none);
        dist_row(
            &mut t,
            "exec round trip",
            "exec_rtt",
            (
                "fork+exec",
                "baseline.fork_exec.p50_ms",
                "ratio.exec_vs_fork_exec",
            ),
        );
        dist_row(&mut t, "daemon GET /v1/sandboxes/{id}", "daemon_get", none);
        value_row(
            &mut t,
            "file write (100 MiB upload)",
            "file_write.mb_per_s",
            none,
        );
        value_row(
            &mut t,
            "file read (100 MiB download)",
            "file_read.mb_per_s",
            none,
        );
        value_row(&mut t, "daemon RSS idle", "daemon.rss_idle_mb", none);
        value_row(
            &mut t,
            "daemon RSS peak under load",
            "daemon.rss_load_peak_mb",
            none,
        );
        for n in &h.idle {
            let k = |name: &str| format!("idle.{n}.{name}");
            if !self.figures.contains_key(&k("per_sandbox_mb")) {
                continue;
            }
            let ratio = |name: &str| format!("ratio.idle_{n}_{name}");
            value_row(
                &mut t,
                &format!("idle {n}: host memory / sandbox"),
                &k("per_sandbox_mb"),
                (
                    "idle bwrap",
                    "baseline.idle_bwrap.per_sandbox_mb",
                    &ratio("vs_bwrap"),
                ),
            );
            value_row(
                &mut t,
                "  agent RSS median",
                &k("agent_rss_median_mb"),
                (
                    "bwrap+sleep",
                    "baseline.idle_bwrap.rss_mb",
                    &ratio("agent_rss_vs_bwrap"),
                ),
            );
            value_row(
                &mut t,
                "  agent PSS median",
                &k("agent_pss_median_mb"),
                (
                    "bwrap+sleep",
                    "baseline.idle_bwrap.pss_mb",
                    &ratio("agent_pss_vs_bwrap"),
                ),
            );
            for (label, name) in [
                ("  released on delete / sandbox", "per_sandbox_released_mb"),
                ("  noise (sample spread / N)", "per_sandbox_noise_mb"),
                ("  agent RSS max", "agent_rss_max_mb"),
                ("  agent PSS max", "agent_pss_max_mb"),
                ("  cgroup memory mean", "cgroup_memory_mb"),
                ("  daemon RSS with them", "daemon_rss_mb"),
                ("  daemon RSS growth / sandbox", "daemon_rss_per_sandbox_mb"),
                ("  create all (total)", "create_total_s"),
                ("  delete all (total)", "delete_total_s"),
                ("  exec `true` failed", "exec_failed"),
            ] {
                value_row(&mut t, label, &k(name), none);
            }
            dist_row(&mut t, "  exec `true` in each", &k("exec"), none);
        }
        if self.figures.contains_key("pause.p50_ms") {
            t.blank();
            dist_row(
                &mut t,
                "pause (freeze)",
                "pause",
                (
                    "cgroup freeze",
                    "baseline.cgroup_freeze.p50_ms",
                    "ratio.pause_vs_cgroup_freeze",
                ),
            );
            dist_row(
                &mut t,
                "resume (thaw)",
                "resume",
                (
                    "cgroup thaw",
                    "baseline.cgroup_thaw.p50_ms",
                    "ratio.resume_vs_cgroup_thaw",
                ),
            );
            dist_row(&mut t, "hibernate (101 MiB)", "hibernate", none);
            dist_row(&mut t, "wake -> first exec", "wake_first_exec", none);
            value_row(
                &mut t,
                "snapshot of 100 MiB, ms",
                "snapshot_full.ms",
                (
                    "tar --zstd",
                    "baseline.tar_zstd.ms",
                    "ratio.snapshot_vs_tar_zstd",
                ),
            );
            value_row(&mut t, "  its size, MB", "snapshot_full.size_mb", none);
            value_row(
                &mut t,
                "incremental (1 MiB), ms",
                "snapshot_incremental.ms",
                none,
            );
            value_row(
                &mut t,
                "  its size, MB",
                "snapshot_incremental.size_mb",
                none,
            );
            value_row(
                &mut t,
                "restore -> first exec, ms",
                "restore_first_exec.first_ms",
                none,
            );
            value_row(
                &mut t,
                "  chain already unpacked",
                "restore_first_exec.cached_ms",
                none,
            );
            value_row(
                &mut t,
                "fork of 10 copies, ms",
                "fork_10.ms",
                ("cp -a x10", "baseline.cp_10.ms", "ratio.fork_10_vs_cp_10"),
            );
        }
        if self.figures.contains_key("proxy_request.p50_ms") {
            t.blank();
            dist_row(
                &mut t,
                "proxy: GET 1 KiB",
                "proxy_request",
                (
                    "direct",
                    "baseline.direct_request.p50_ms",
                    "ratio.proxy_request_vs_direct",
                ),
            );
            value_row(
                &mut t,
                "  added p50, ms",
                "proxy_request.added_p50_ms",
                none,
            );
            value_row(
                &mut t,
                "proxy: 64 MiB download, MB/s",
                "proxy_download.mb_per_s",
                (
                    "direct",
                    "baseline.direct_download.mb_per_s",
                    "ratio.proxy_download_vs_direct",
                ),
            );
        }
        if self
            .figures
            .contains_key("e2b_sdk_create_first_exec.p50_ms")
        {
            t.blank();
            dist_row(
                &mut t,
                "E2B SDK create -> run(true)",
                "e2b_sdk_create_first_exec",
                (
                    "native API",
                    "baseline.native_create_first_exec.p50_ms",
                    "ratio.e2b_sdk_vs_native",
                ),
            );
        }
        if self
            .figures
            .contains_key("net.create_open_first_exec.p50_ms")
        {
            t.blank();
            dist_row(
                &mut t,
                "create (link down) -> exec",
                "net.create_none_first_exec",
                none,
            );
            dist_row(
                &mut t,
                "create (link up) -> exec",
                "net.create_open_first_exec",
                none,
            );
            value_row(
                &mut t,
                "  up minus down, p50",
                "net.create_open_minus_none.p50_ms",
                none,
            );
            value_row(
                &mut t,
                "  up minus down, p95",
                "net.create_open_minus_none.p95_ms",
                none,
            );
            dist_row(&mut t, "  link up + route (netlink)", "net.link_up", none);
            dist_row(
                &mut t,
                "connect via the proxy",
                "net.proxy_connect",
                ("direct", "baseline.direct_connect.p50_ms", ""),
            );
            value_row(&mut t, "  added, p50", "net.proxy_added.p50_ms", none);
            value_row(&mut t, "  added, p95", "net.proxy_added.p95_ms", none);
            value_row(
                &mut t,
                "proxy throughput",
                "net.proxy_throughput.mb_per_s",
                (
                    "direct",
                    "baseline.direct_throughput.mb_per_s",
                    "ratio.proxy_vs_direct_throughput",
                ),
            );
        }
        if self.figures.contains_key("agent_first_event.p50_ms") {
            t.blank();
            dist_row(
                &mut t,
                "agent run -> first stored event",
                "agent_first_event",
                (
                    "pi --version (exec)",
                    "baseline.pi_version_exec.p50_ms",
                    "ratio.agent_first_event_vs_pi_exec",
                ),
            );
            base_row(
                &mut t,
                "pi --version fork+exec",
                "baseline.pi_version_fork_exec.p50_ms",
                "ratio.agent_first_event_vs_pi_fork_exec",
            );
            dist_row(
                &mut t,
                "  -> first event to a follower",
                "agent_first_event_follower",
                none,
            );
            value_row(
                &mut t,
                "fan-out: all followers read all, ms",
                "agent_fanout.wall_ms",
                (
                    "one follower",
                    "agent_single.wall_ms",
                    "ratio.agent_fanout_vs_single",
                ),
            );
            dist_row(
                &mut t,
                "  delivery lag, fan-out",
                "agent_fanout_lag",
                (
                    "one follower p95",
                    "agent_single_lag.p95_ms",
                    "ratio.agent_fanout_lag_vs_single",
                ),
            );
            value_row(&mut t, "events stored / s", "agent_events.per_s", none);
        }
        let baselines = self.figures.keys().any(|k| k.starts_with("baseline."));
        if baselines {
            t.blank();
            t.row(["baseline", "p50", "p95", "p99", "", "", ""]);
        }
        for (label, prefix) in [
            ("fork+exec /bin/true", "baseline.fork_exec"),
            ("unshare (sandpit's ns) true", "baseline.unshare"),
            ("bwrap --unshare-all true", "baseline.bwrap"),
            ("crun run true", "baseline.crun_run"),
            ("  unshare wrapper alone", "baseline.unshare_wrapper"),
            ("crun run, N at once", "baseline.crun_run_concurrent"),
            ("runsc --platform=ptrace run", "baseline.runsc_ptrace"),
            ("netns + veth via netlink", "baseline.netns_prepare"),
            ("  unshare netns alone", "baseline.unshare_netns"),
            ("direct connect (no proxy)", "baseline.direct_connect"),
            ("pi --version via the exec API", "baseline.pi_version_exec"),
            (
                "pi --version fork+exec (host)",
                "baseline.pi_version_fork_exec",
            ),
        ] {
            let p50 = format!("{prefix}.p50_ms");
            // The wrapper row exists only where the cgroup layout needs the wrapper.
            if !self.figures.contains_key(&p50)
                || (label.starts_with(' ') && self.get(&p50).is_none())
            {
                continue;
            }
            t.row([
                label,
                &self.fmt(&p50),
                &self.fmt(&format!("{prefix}.p95_ms")),
                &self.fmt(&format!("{prefix}.p99_ms")),
                "",
                "",
                "",
            ]);
        }
        for (label, key) in [
            (
                "idle bwrap: host memory / one",
                "baseline.idle_bwrap.per_sandbox_mb",
            ),
            (
                "  released on kill / one",
                "baseline.idle_bwrap.per_sandbox_released_mb",
            ),
            ("  RSS of bwrap+sleep", "baseline.idle_bwrap.rss_mb"),
            ("  PSS of bwrap+sleep", "baseline.idle_bwrap.pss_mb"),
        ] {
            if self.figures.contains_key(key) {
                t.row([label, &self.fmt(key), "", "", "", "", ""]);
            }
        }
        out.push_str(&t.render());
        if !self.notes.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "notes:");
            for (k, v) in &self.notes {
                let _ = writeln!(out, "  {k}: {v}");
            }
        }
        out
    }
}

/// Rows of seven columns, aligned when rendered.
#[derive(Default)]
struct Table {
    rows: Vec<Option<[String; 7]>>,
}

impl Table {
    fn row(&mut self, cols: [&str; 7]) {
        self.rows.push(Some(cols.map(str::to_string)));
    }

    fn blank(&mut self) {
        self.rows.push(None);
    }

    fn render(&self) -> String {
        let mut width = [0usize; 7];
        for row in self.rows.iter().flatten() {
            for (w, c) in width.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        for row in &self.rows {
            let Some(row) = row else {
                out.push('\n');
                continue;
            };
            let mut line = String::new();
            for (i, (c, w)) in row.iter().zip(width).enumerate() {
                // Numbers right-aligned, words left-aligned.
                let cell = if matches!(i, 1..=3 | 5) {
                    format!("{c:>w$}")
                } else {
                    format!("{c:<w$}")
                };
                line.push_str(&cell);
                line.push_str("  ");
            }
            let _ = writeln!(out, "{}", line.trim_end());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        let d = Dist::of(&s).unwrap();
        assert!((d.p50 - 50.5).abs() < 1e-9);
        assert!((d.p95 - 95.05).abs() < 1e-9);
        assert!((d.p99 - 99.01).abs() < 1e-9);
        assert!(Dist::of(&[]).is_none());
        let one = Dist::of(&[3.0]).unwrap();
        assert_eq!((one.p50, one.p95, one.p99), (3.0, 3.0, 3.0));
        // Order of the input does not matter.
        assert_eq!(Dist::of(&[3.0, 1.0, 2.0]).unwrap().p50, 2.0);
    }

    #[test]
    fn the_specification_parses_and_names_known_figures() {
        let all = parse_targets(SPECIFICATION).expect("SPECIFICATION.md parses");
        assert!(all.iter().any(|t| t.kind == Kind::Promise));
        assert!(all.iter().any(|t| t.kind == Kind::Target));
        // Every promise is a ratio to a baseline or the daemon's own size.
        for t in all.iter().filter(|t| t.kind == Kind::Promise) {
            assert!(
                t.key.starts_with("ratio.") || t.key.starts_with("daemon."),
                "{}",
                t.key
            );
        }
        assert_eq!(targets().len(), all.len());
    }

    #[test]
    fn a_malformed_row_is_an_error() {
        let spec = |row: &str| {
            format!("<!-- figures:begin -->\n| figure | goal |\n{row}\n<!-- figures:end -->")
        };
        assert!(parse_targets(&spec("| `a.b` | <= | 1 | ms | target | |")).is_ok());
        assert!(parse_targets(&spec("| `a.b` | == | 1 | ms | target | |")).is_err());
        assert!(parse_targets(&spec("| `a.b` | <= | one | ms | target | |")).is_err());
        assert!(parse_targets(&spec("| `a.b` | <= | 1 | ms | wish | |")).is_err());
        assert!(parse_targets("no markers").is_err());
    }

    #[test]
    fn a_star_stands_for_one_part() {
        assert!(key_matches(
            "idle.*.per_sandbox_mb",
            "idle.100.per_sandbox_mb"
        ));
        assert!(!key_matches(
            "idle.*.per_sandbox_mb",
            "idle.1.2.per_sandbox_mb"
        ));
        assert!(key_matches(
            "ratio.idle_*_vs_bwrap",
            "ratio.idle_1000_vs_bwrap"
        ));
        assert!(!key_matches(
            "ratio.idle_*_vs_bwrap",
            "ratio.idle_1000_agent_rss_vs_bwrap.x"
        ));
        assert!(!key_matches("a.b", "a.bc"));
    }

    #[test]
    fn targets_match_idle_counts() {
        assert_eq!(
            target_of("idle.1000.per_sandbox_mb").map(|t| t.value),
            Some(3.0)
        );
        assert!(target_of("idle.1000.per_sandbox_noise_mb").is_none());
        assert!(target_of("idle.per_sandbox_mb").is_none());
        assert_eq!(
            target_of("sustained.cycles_per_s").map(|t| t.goal),
            Some(Goal::AtLeast)
        );
    }

    fn header() -> Header {
        Header {
            url: "http://127.0.0.1:1".into(),
            daemon_version: "0".into(),
            started: "20250101-000000".into(),
            iterations: 3,
            concurrency: 50,
            workers: 8,
            sustained_secs: 30,
            idle: vec![100],
            phases: vec!["cold".into()],
        }
    }

    #[test]
    fn json_shape() {
        let mut r = Report::default();
        r.set_dist("cold_first_exec", Ok(vec![1.0, 2.0, 3.0]));
        r.set_dist(
            "pool_first_exec",
            Err("pool: not supported by this daemon".into()),
        );
        r.set("baseline.crun_run.p50_ms", Some(4.0));
        r.set_ratio(
            "cold_vs_crun_run",
            "cold_first_exec.p50_ms",
            "baseline.crun_run.p50_ms",
        );
        let j = r.to_json(&header());
        assert_eq!(j["figures"]["cold_first_exec.p50_ms"], 2.0);
        assert_eq!(j["figures"]["cold_first_exec.p99_ms"], 2.98);
        assert_eq!(j["figures"]["pool_first_exec.p95_ms"], Value::Null);
        assert_eq!(j["figures"]["ratio.cold_vs_crun_run"], 0.5);
        assert_eq!(
            j["notes"]["pool_first_exec"],
            "pool: not supported by this daemon"
        );
        assert_eq!(j["samples_ms"]["cold_first_exec"], json!([1.0, 2.0, 3.0]));
        assert_eq!(j["targets"]["sustained.cycles_per_s"]["at_least"], 300.0);
        assert_eq!(j["idle"], json!([100]));
    }

    #[test]
    fn table_shows_verdicts() {
        let mut r = Report::default();
        r.set_dist("cold_first_exec", Ok(vec![5.0, 6.0, 7.0]));
        r.set("sustained.cycles_per_s", Some(120.0));
        let table = r.to_table(&header());
        assert!(table.contains("p50 <= 8 ms (met)"), "{table}");
        assert!(table.contains("cycles_per_s >= 300 /s (missed)"), "{table}");
    }
}
