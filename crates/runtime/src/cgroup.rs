//! Per-sandbox cgroups on v1 (including the hybrid layout), and v2. Every sandbox gets
//! `sandpit/<id>` under each controller it needs; the path is always explicit.

use crate::{Limits, RuntimeError, Stats};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const CPU_PERIOD_US: u64 = 100_000;
const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];

/// Which cgroup hierarchy the host has.
#[derive(Debug, Clone)]
pub enum Layout {
    /// One unified tree.
    V2 { root: PathBuf },
    /// One tree per controller (also the "hybrid" layout, where only v1 controllers matter).
    V1 {
        controllers: Vec<(&'static str, PathBuf)>,
    },
}

/// Manages the `sandpit/<id>` cgroups.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Layout,
    /// Parent cgroup name; one per daemon data directory, so that daemons side by side
    /// (tests, several users) never sweep each other's sandboxes.
    parent: String,
}

fn write(path: &Path, value: &str) -> Result<(), RuntimeError> {
    std::fs::write(path, value).map_err(|source| RuntimeError::Cgroup {
        path: path.display().to_string(),
        source,
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of `key` in a flat-keyed cgroup file (`memory.stat`: `key value` lines).
fn stat_field(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

impl Cgroups {
    /// Finds the host's layout under `root` (normally /sys/fs/cgroup).
    pub fn detect(root: &Path, parent: &str) -> Result<Self, RuntimeError> {
        crate::check_id(parent)?;
        let parent = parent.to_string();
        if root.join("cgroup.controllers").exists() {
            return Ok(Self {
                layout: Layout::V2 {
                    root: root.to_path_buf(),
                },
                parent,
            });
        }
        let mut controllers = Vec::new();
        for name in V1_CONTROLLERS {
            let p = root.join(name);
            if p.join("cgroup.procs").exists() {
                controllers.push((name, p));
            }
        }
        for needed in ["memory", "pids", "cpu", "freezer"] {
            if !controllers.iter().any(|(n, _)| *n == needed) {
                return Err(RuntimeError::Setup(format!(
                    "cgroup v1 controller {needed} is not mounted under {}",
                    root.display()
                )));
            }
        }
        Ok(Self {
            layout: Layout::V1 { controllers },
            parent,
        })
    }

    /// The layout in use.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Directories making up one sandbox's cgroup (one per v1 controller, or one on v2).
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V2 { root } => vec![root.join(&self.parent).join(id)],
            Layout::V1 { controllers } => {
                let mut v: Vec<PathBuf> = controllers
                    .iter()
                    .map(|(_, p)| p.join(&self.parent).join(id))
                    .collect();
                v.dedup();
                v
            }
        }
    }

    fn dir_of(&self, controller: &str, id: &str) -> Option<PathBuf> {
        match &self.layout {
            Layout::V2 { root } => Some(root.join(&self.parent).join(id)),
            Layout::V1 { controllers } => controllers
                .iter()
                .find(|(n, _)| *n == controller)
                .map(|(_, p)| p.join(&self.parent).join(id)),
        }
    }

    /// The files a single-threaded process writes "0" into to join the sandbox.
    ///
    /// On v1 that is `tasks`: moving only the calling thread lets the kernel skip the
    /// global threadgroup lock, whose write side waits for an RCU grace period (7-15 ms
    /// per sandbox here, against 60 µs). For a process of one thread it is the same move.
    pub fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        let file = match self.layout {
            Layout::V2 { .. } => "cgroup.procs",
            Layout::V1 { .. } => "tasks",
        };
        self.dirs(id).into_iter().map(|d| d.join(file)).collect()
    }

    /// Creates the sandbox's cgroup with its limits.
    pub fn create(&self, id: &str, limits: &Limits) -> Result<(), RuntimeError> {
        crate::check_id(id)?;
        if let Layout::V2 { root } = &self.layout {
            let parent = root.join(&self.parent);
            mkdir(&parent)?;
            // Controllers must be delegated level by level before a child can use them.
            write(&root.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
            write(&parent.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
        }
        for d in self.dirs(id) {
            if let Some(parent) = d.parent() {
                mkdir(parent)?;
            }
            mkdir(&d)?;
        }
        let quota = (limits.cpu_millis * CPU_PERIOD_US / 1000).max(1000);
        match &self.layout {
            Layout::V2 { root } => {
                let d = root.join(&self.parent).join(id);
                write(&d.join("memory.max"), &limits.memory_bytes.to_string())?;
                if d.join("memory.swap.max").exists() {
                    write(&d.join("memory.swap.max"), "0")?;
                }
                write(&d.join("pids.max"), &limits.max_processes.to_string())?;
                write(&d.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
            }
            Layout::V1 { .. } => {
                if let Some(m) = self.dir_of("memory", id) {
                    write(
                        &m.join("memory.limit_in_bytes"),
                        &limits.memory_bytes.to_string(),
                    )?;
                    let memsw = m.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        write(&memsw, &limits.memory_bytes.to_string())?;
                    }
                }
                if let Some(p) = self.dir_of("pids", id) {
                    write(&p.join("pids.max"), &limits.max_processes.to_string())?;
                }
                if let Some(c) = self.dir_of("cpu", id) {
                    write(&c.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                    write(&c.join("cpu.cfs_quota_us"), &quota.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// Freezes or thaws every process of the sandbox and waits until that has happened.
    pub fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        match &self.layout {
            Layout::V2 { root } => {
                let d = root.join(&self.parent).join(id);
                write(&d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
                let want = if frozen { "frozen 1" } else { "frozen 0" };
                while Instant::now() < deadline {
                    let ev = std::fs::read_to_string(d.join("cgroup.events")).unwrap_or_default();
                    if ev.lines().any(|l| l.trim() == want) {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Layout::V1 { .. } => {
                let d = self
                    .dir_of("freezer", id)
                    .ok_or_else(|| RuntimeError::Unsupported("no freezer".into()))?;
                let want = if frozen { "FROZEN" } else { "THAWED" };
                write(&d.join("freezer.state"), want)?;
                while Instant::now() < deadline {
                    if std::fs::read_to_string(d.join("freezer.state"))
                        .unwrap_or_default()
                        .trim()
                        == want
                    {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        Err(RuntimeError::Setup(format!(
            "sandbox {id} did not reach the {} state",
            if frozen { "frozen" } else { "thawed" }
        )))
    }

    /// Pids currently in the sandbox's cgroup.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        let mut out = Vec::new();
        for d in self.dirs(id) {
            if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
                out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Kills every process in the cgroup and waits until it is empty.
    pub fn kill_all(&self, id: &str) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        if let Layout::V2 { root } = &self.layout {
            let kill = root.join(&self.parent).join(id).join("cgroup.kill");
            if kill.exists() {
                let _ = write(&kill, "1");
            }
        }
        loop {
            let pids = self.pids(id);
            if pids.is_empty() {
                return Ok(());
            }
            for pid in &pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            // A frozen task cannot die; thaw so the pending SIGKILL is delivered.
            let _ = self.thaw_quick(id);
            if Instant::now() > deadline {
                return Err(RuntimeError::Setup(format!(
                    "processes of sandbox {id} did not die: {pids:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn thaw_quick(&self, id: &str) -> Result<(), RuntimeError> {
        match &self.layout {
            Layout::V2 { root } => {
                write(&root.join(&self.parent).join(id).join("cgroup.freeze"), "0")
            }
            Layout::V1 { .. } => match self.dir_of("freezer", id) {
                Some(d) => write(&d.join("freezer.state"), "THAWED"),
                None => Ok(()),
            },
        }
    }

    /// Removes the sandbox's cgroup directories (after `kill_all`); missing ones are fine.
    pub fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        for d in self.dirs(id) {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match std::fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // Busy while the last tasks finish exiting.
                    Err(e)
                        if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) =>
                    {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(source) => {
                        return Err(RuntimeError::Cgroup {
                            path: d.display().to_string(),
                            source,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The parent cgroup directory in every hierarchy.
    fn parent_dirs(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V2 { root } => vec![root.join(&self.parent)],
            Layout::V1 { controllers } => controllers
                .iter()
                .map(|(_, p)| p.join(&self.parent))
                .collect(),
        }
    }

    /// Removes the parent cgroup if no sandbox cgroup is left below it.
    pub fn remove_parent_if_empty(&self) {
        let parents = self.parent_dirs();
        for p in parents {
            // rmdir refuses a cgroup with children, which is exactly the guard wanted here.
            let _ = std::fs::remove_dir(p);
        }
    }

    /// Ids of every sandbox cgroup that exists.
    pub fn list(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let parents = self.parent_dirs();
        for p in parents {
            if let Ok(rd) = std::fs::read_dir(&p) {
                for e in rd.flatten() {
                    if let (true, Some(n)) = (e.path().is_dir(), e.file_name().to_str()) {
                        ids.push(n.to_string());
                    }
                }
            }
        }
        ids.sort();
        ids.dedup();
        ids
    }

    /// Resource usage of the sandbox.
    pub fn stats(&self, id: &str) -> Stats {
        match &self.layout {
            Layout::V2 { root } => {
                let d = root.join(&self.parent).join(id);
                let usage_usec = std::fs::read_to_string(d.join("cpu.stat"))
                    .ok()
                    .and_then(|s| {
                        s.lines().find_map(|l| {
                            l.strip_prefix("usage_usec ")
                                .and_then(|v| v.trim().parse::<u64>().ok())
                        })
                    })
                    .unwrap_or(0);
                Stats {
                    cpu_usage_ns: usage_usec * 1000,
                    memory_current_bytes: read_u64(&d.join("memory.current")).unwrap_or(0),
                    memory_peak_bytes: read_u64(&d.join("memory.peak")).unwrap_or(0),
                    pids_current: read_u64(&d.join("pids.current")).unwrap_or(0),
                    memory_cache_bytes: stat_field(&d.join("memory.stat"), "file").unwrap_or(0),
                }
            }
            Layout::V1 { .. } => {
                let get = |ctl: &str, file: &str| {
                    self.dir_of(ctl, id)
                        .and_then(|d| read_u64(&d.join(file)))
                        .unwrap_or(0)
                };
                Stats {
                    cpu_usage_ns: get("cpuacct", "cpuacct.usage"),
                    memory_current_bytes: get("memory", "memory.usage_in_bytes"),
                    memory_peak_bytes: get("memory", "memory.max_usage_in_bytes"),
                    pids_current: get("pids", "pids.current"),
                    // `total_cache` counts child cgroups too; `cache` alone on kernels
                    // that lack it.
                    memory_cache_bytes: self
                        .dir_of("memory", id)
                        .and_then(|d| {
                            let f = d.join("memory.stat");
                            stat_field(&f, "total_cache").or_else(|| stat_field(&f, "cache"))
                        })
                        .unwrap_or(0),
                }
            }
        }
    }
}

fn mkdir(p: &Path) -> Result<(), RuntimeError> {
    match std::fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(RuntimeError::Cgroup {
            path: p.display().to_string(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_v2_by_its_controllers_file() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), "memory pids cpu").unwrap();
        let cg = Cgroups::detect(t.path(), "sandpit").unwrap();
        assert!(matches!(cg.layout(), Layout::V2 { .. }));
        assert_eq!(cg.dirs("abc"), vec![t.path().join("sandpit/abc")]);
    }

    #[test]
    fn v2_limits_are_written_in_v2_syntax() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), "memory pids cpu").unwrap();
        let cg = Cgroups::detect(t.path(), "sandpit").unwrap();
        let limits = Limits {
            cpu_millis: 500,
            memory_bytes: 1 << 20,
            disk_bytes: 0,
            max_processes: 7,
        };
        cg.create("s1", &limits).unwrap();
        let d = t.path().join("sandpit/s1");
        assert_eq!(
            std::fs::read_to_string(d.join("cpu.max")).unwrap(),
            "50000 100000"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("memory.max")).unwrap(),
            "1048576"
        );
        assert_eq!(std::fs::read_to_string(d.join("pids.max")).unwrap(), "7");
        assert_eq!(
            std::fs::read_to_string(t.path().join("cgroup.subtree_control")).unwrap(),
            "+memory +pids +cpu"
        );
        assert_eq!(cg.list(), vec!["s1".to_string()]);
    }

    #[test]
    fn stats_read_both_layouts_and_the_page_cache() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), "memory pids cpu").unwrap();
        let cg = Cgroups::detect(t.path(), "sandpit").unwrap();
        let d = t.path().join("sandpit/s1");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cpu.stat"), "usage_usec 1500\nuser_usec 1000\n").unwrap();
        std::fs::write(d.join("memory.current"), "9000\n").unwrap();
        std::fs::write(
            d.join("memory.stat"),
            "anon 100\nfile_mapped 7\nfile 4096\n",
        )
        .unwrap();
        let s = cg.stats("s1");
        assert_eq!(s.cpu_usage_ns, 1_500_000);
        assert_eq!(s.memory_current_bytes, 9000);
        assert_eq!(s.memory_cache_bytes, 4096, "`file`, not `file_mapped`");
        assert_eq!(cg.stats("missing"), Stats::default());

        let t = tempfile::tempdir().unwrap();
        for c in ["memory", "pids", "cpu", "cpuacct", "freezer"] {
            std::fs::create_dir_all(t.path().join(c).join("sandpit/s1")).unwrap();
            std::fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let cg = Cgroups::detect(t.path(), "sandpit").unwrap();
        let m = t.path().join("memory/sandpit/s1");
        std::fs::write(m.join("memory.usage_in_bytes"), "8000").unwrap();
        std::fs::write(m.join("memory.stat"), "cache 10\nrss 5\ntotal_cache 30\n").unwrap();
        std::fs::write(t.path().join("cpuacct/sandpit/s1/cpuacct.usage"), "77").unwrap();
        let s = cg.stats("s1");
        assert_eq!(
            (s.cpu_usage_ns, s.memory_current_bytes, s.memory_cache_bytes),
            (77, 8000, 30)
        );
        std::fs::write(m.join("memory.stat"), "cache 10\nrss 5\n").unwrap();
        assert_eq!(cg.stats("s1").memory_cache_bytes, 10);
    }

    #[test]
    fn v1_requires_its_controllers() {
        let t = tempfile::tempdir().unwrap();
        assert!(Cgroups::detect(t.path(), "sandpit").is_err());
        for c in ["memory", "pids", "cpu", "cpuacct", "freezer"] {
            std::fs::create_dir_all(t.path().join(c)).unwrap();
            std::fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let cg = Cgroups::detect(t.path(), "sandpit").unwrap();
        assert!(matches!(cg.layout(), Layout::V1 { .. }));
        assert_eq!(cg.dirs("x").len(), 5);
        assert!(
            cg.create(
                "../escape",
                &Limits {
                    cpu_millis: 1,
                    memory_bytes: 1,
                    disk_bytes: 1,
                    max_processes: 1
                }
            )
            .is_err()
        );
    }
}
