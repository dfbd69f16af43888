//! The `process` runtime, for development only: the agent runs as a plain host process in
//! its own session with rlimits and a per-sandbox directory. It is NOT isolated: commands
//! see the host. The daemon's secrets are kept out of its environment.

use crate::{
    Capabilities, Runtime, RuntimeError, SandboxHandle, SandboxSpec, Stats, TemplateSource,
};
use sandpit_abi::{AgentConfig, IsolationMode};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Environment names never passed on from the daemon, whatever their value.
const SECRET_NAMES: &[&str] = &[
    "DATABASE_URL",
    "SANDPIT_API_KEY",
    sandpit_abi::CONFIG_ENV,
    "AWS_SESSION_TOKEN",
    "GITHUB_TOKEN",
];
/// Name fragments that mark a variable as secret.
const SECRET_PARTS: &[&str] = &[
    "KEY",
    "SECRET",
    "TOKEN",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "AUTH",
];

/// Whether an environment variable of the daemon must not reach a sandbox.
pub fn is_secret(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    SECRET_NAMES.contains(&upper.as_str()) || SECRET_PARTS.iter().any(|p| upper.contains(p))
}

/// The environment a process sandbox starts with: the daemon's, minus secrets, plus what
/// the caller passed explicitly (which wins, even for secret-looking names).
pub fn sandbox_env(
    daemon: impl Iterator<Item = (String, String)>,
    explicit: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = daemon.filter(|(k, _)| !is_secret(k)).collect();
    env.extend(explicit.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// Runs the agent as an ordinary host process.
pub struct ProcessRuntime {
    sandboxes_dir: PathBuf,
    self_exe: PathBuf,
    /// Agent sockets of sandboxes created but not started yet.
    pending: crate::PendingSockets,
}

impl ProcessRuntime {
    /// A runtime keeping sandboxes under `data_dir/sandboxes`.
    pub fn new(data_dir: &Path, self_exe: PathBuf) -> Result<Self, RuntimeError> {
        let sandboxes_dir = data_dir.join("sandboxes");
        crate::private_dir(&sandboxes_dir)?;
        Ok(Self {
            sandboxes_dir,
            self_exe,
            pending: Default::default(),
        })
    }

    fn prepare(&self, spec: &SandboxSpec, dir: &Path) -> Result<SandboxHandle, RuntimeError> {
        let root = dir.join("root");
        for d in ["home/user", "tmp", "workspace", "root"] {
            std::fs::create_dir_all(root.join(d))
                .map_err(|e| RuntimeError::io(format!("create {d}"), e))?;
        }
        let socket = self.pending.bind(&spec.id, dir)?;
        Ok(SandboxHandle {
            id: spec.id.clone(),
            pid: 0,
            pid_start: 0,
            socket,
            dir: dir.to_path_buf(),
            uid_base: None,
            net: None,
        })
    }

    fn launch(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        let listener = self.pending.take(&spec.id)?;
        let root = h.dir.join("root");
        let env = sandbox_env(std::env::vars(), &spec.env);
        let agent = AgentConfig {
            mode: IsolationMode::Process,
            root: root.clone(),
            workdir: spec.workdir.clone(),
            env,
            listen_fd: Some(crate::container::LISTEN_FD),
            listen_path: None,
            sudo: false,
            live: Default::default(),
        };
        let cfg = serde_json::to_string(&agent).map_err(|source| RuntimeError::Encode {
            what: "agent config",
            source,
        })?;
        let limits = spec.limits;
        let listen_raw = listener.as_raw_fd();
        let mut cmd = Command::new(&self.self_exe);
        cmd.arg0(crate::init::AGENT_ARGV0)
            .env_clear()
            .env(sandpit_abi::CONFIG_ENV, cfg)
            .current_dir(&root)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only raw syscalls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                let set = |res, v: u64| {
                    let l = libc::rlimit {
                        rlim_cur: v,
                        rlim_max: v,
                    };
                    libc::setrlimit(res, &l);
                };
                set(libc::RLIMIT_DATA, limits.memory_bytes);
                set(libc::RLIMIT_FSIZE, limits.disk_bytes);
                set(libc::RLIMIT_NPROC, limits.max_processes);
                set(libc::RLIMIT_CORE, 0);
                crate::pass_fd(listen_raw, crate::container::LISTEN_FD)?;
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| RuntimeError::io("spawn agent", e))?;
        let pid = child.id() as i32;
        // The daemon is the parent; `destroy` reaps it.
        drop(child);
        h.pid = pid;
        h.pid_start = crate::pid_start_time(pid)
            .ok_or_else(|| RuntimeError::Setup("agent exited at once".into()))?;
        Ok(())
    }
}

impl Runtime for ProcessRuntime {
    /// Nothing up front: killing the agent first would orphan its commands (each in a
    /// session of its own) before `destroy` could find them through it.
    fn begin_stop(&self, _h: &SandboxHandle) {}

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "process",
            isolated: false,
            freeze: false,
            stats: false,
            enforces_memory: false,
            enforces_disk: false,
            enforces_processes: false,
        }
    }

    fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        crate::check_id(&spec.id)?;
        if spec.template != TemplateSource::Host {
            return Err(RuntimeError::Unsupported(
                "the process runtime only runs the host template".into(),
            ));
        }
        if !spec.layers.is_empty() {
            return Err(RuntimeError::Unsupported(
                "the process runtime cannot start from snapshots or forks".into(),
            ));
        }
        if !spec.volumes.is_empty() {
            return Err(RuntimeError::InvalidSpec(
                "volumes need the container runtime".into(),
            ));
        }
        let dir = self.sandboxes_dir.join(&spec.id);
        std::fs::create_dir(&dir)
            .map_err(|e| RuntimeError::io(format!("create {}", dir.display()), e))?;
        self.prepare(spec, &dir).inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&dir);
        })
    }

    fn start(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        self.launch(spec, h)
    }

    fn kill(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        if h.pid > 0 && crate::same_process(h.pid, h.pid_start) {
            sandpit_abi::kill_tree(h.pid as u32, nix::sys::signal::Signal::SIGKILL);
        }
        if h.pid > 0 {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(h.pid), None);
        }
        Ok(())
    }

    fn freeze(&self, _h: &SandboxHandle) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(
            "the process runtime cannot freeze".into(),
        ))
    }

    fn thaw(&self, _h: &SandboxHandle) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(
            "the process runtime cannot freeze".into(),
        ))
    }

    fn stats(&self, _h: &SandboxHandle) -> Result<Stats, RuntimeError> {
        Err(RuntimeError::Unsupported(
            "the process runtime keeps no resource accounting".into(),
        ))
    }

    fn liveness(&self, h: &SandboxHandle) -> crate::Liveness {
        crate::process_liveness(h.pid, h.pid_start)
    }

    fn destroy(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        crate::check_id(&h.id)?;
        self.pending.forget(&h.id);
        self.kill(h)?;
        let dir = self.sandboxes_dir.join(&h.id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(format!("remove {}", dir.display()), e)),
        }
    }

    fn remove_orphans(&self, _keep: &[String]) -> Result<Vec<String>, RuntimeError> {
        // Both runtimes share the sandboxes directory; the container runtime sweeps it.
        Ok(Vec::new())
    }

    fn adopt(&self, _h: &SandboxHandle) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_stripped_unless_passed_explicitly() {
        let daemon = [
            ("PATH", "/usr/bin"),
            ("DATABASE_URL", "postgres://x"),
            ("OPENAI_API_KEY", "sk-1"),
            ("MY_SECRET_THING", "s"),
            ("GH_TOKEN", "t"),
            ("DB_PASSWORD", "p"),
            ("AZURE_CREDENTIALS", "c"),
            ("LANG", "C"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let explicit: BTreeMap<String, String> =
            [("GH_TOKEN".to_string(), "mine".to_string())].into();
        let env = sandbox_env(daemon, &explicit);
        let keys: Vec<&str> = env.keys().map(String::as_str).collect();
        assert_eq!(keys, vec!["GH_TOKEN", "LANG", "PATH"]);
        assert_eq!(env["GH_TOKEN"], "mine");
    }
}
