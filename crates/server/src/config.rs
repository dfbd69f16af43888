//! The daemon's config file (TOML): warm pools, `[pool_limits]` and the `[lifecycle]`, `[snapshots]`,
//! `[e2b]`, `[proxy]`, `[broker]`, `[network]` and `[http]` sections; flags carry the
//! settings a daemon needs before it can read a file (listen address, data directory).

use crate::ServerError;
use sandpit_api::PoolSpec;
use serde::Deserialize;
use std::path::Path;

/// Name of the config file looked for in the data directory when `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "config.toml";

/// A setting the daemon refuses, or a config file it cannot parse.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is not TOML of the expected shape.
    #[error(transparent)]
    Parse(#[from] toml::de::Error),
    /// A number outside its range.
    #[error("{name} must be between {min} and {max}")]
    OutOfRange {
        name: &'static str,
        min: u64,
        max: u64,
    },
    /// A cap or count of zero, which would refuse everything.
    #[error("{name} must be at least 1")]
    Zero { name: &'static str },
    /// `proxy.scheme` is neither http nor https.
    #[error("proxy.scheme must be http or https, not {0:?}")]
    Scheme(String),
    /// `proxy.domain` is not a host name (with an optional port).
    #[error("proxy.domain {0:?} is not a host name")]
    Domain(String),
    /// Two `[[pools]]` share a name.
    #[error("pool {0:?} is declared twice")]
    DuplicatePool(String),
    /// `[agents] harness_dir` cannot be resolved.
    #[error("[agents] harness_dir {}: {source}", dir.display())]
    HarnessDir {
        dir: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Contents of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Warm pools kept by the daemon (`[[pools]]` tables). Removing one from the file
    /// removes the pool at the next start; pools created through the API are not touched.
    #[serde(default)]
    pub pools: Vec<PoolSpec>,
    /// Idle, pause and lifetime rules (`[lifecycle]`).
    #[serde(default)]
    pub lifecycle: crate::lifecycle::LifecycleConfig,
    /// Where snapshots are stored (`[snapshots]`, default: `DATA_DIR/snapshots`).
    #[serde(default)]
    pub snapshots: crate::snapshots::SnapshotStoreConfig,
    /// E2B compatibility: template aliases and defaults (`[e2b]`).
    #[serde(default)]
    pub e2b: crate::api::e2b::E2bConfig,
    /// The sandbox data-plane proxy (`[proxy]`: domain of `{port}-{id}.{domain}` names).
    #[serde(default)]
    pub proxy: crate::ingress::ProxyConfig,
    /// The credential broker's key and upstream trust (`[broker]`).
    #[serde(default)]
    pub broker: crate::broker::BrokerConfig,
    /// Sandbox networking (`[network]`).
    #[serde(default)]
    pub network: crate::net::NetworkConfig,
    /// Limits of the HTTP listener (`[http]`: timeouts, connection caps).
    #[serde(default)]
    pub http: crate::listener::HttpConfig,
    /// Agent runs (`[agents]`: where the harness installs are).
    #[serde(default)]
    pub agents: AgentsFileConfig,
    /// Bounds on warm pools (`[pool_limits]`: `max_size`, default 64).
    #[serde(default)]
    pub pool_limits: crate::pools::PoolLimits,
    /// Approvals of agent runs' risky actions (`[approvals]`).
    #[serde(default)]
    pub approvals: ApprovalsFileConfig,
}

/// The `[approvals]` section.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalsFileConfig {
    /// Seconds an approval waits for a decision when the runtime's policy names none
    /// (default 300, at most a day).
    pub timeout_secs: u64,
    /// Only API keys with the `approver` role may approve or deny.
    pub require_approver_role: bool,
}

impl Default for ApprovalsFileConfig {
    fn default() -> Self {
        let core = sandpit_core::approvals::ApprovalsConfig::default();
        ApprovalsFileConfig {
            timeout_secs: core.timeout_secs,
            require_approver_role: core.require_approver_role,
        }
    }
}

impl ApprovalsFileConfig {
    /// The core's settings, checked.
    pub fn resolve(&self) -> Result<sandpit_core::approvals::ApprovalsConfig, ConfigError> {
        const DAY: u64 = 24 * 60 * 60;
        if !(1..=DAY).contains(&self.timeout_secs) {
            return Err(ConfigError::OutOfRange {
                name: "approvals.timeout_secs",
                min: 1,
                max: DAY,
            });
        }
        Ok(sandpit_core::approvals::ApprovalsConfig {
            timeout_secs: self.timeout_secs,
            require_approver_role: self.require_approver_role,
        })
    }
}

/// The `[agents]` section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentsFileConfig {
    /// Host directory of the harness installs (`node_modules/.bin/pi`, ...), bound
    /// read-only into `host` sandboxes. Default: the build tree's `.deps/harnesses`
    /// (where `scripts/setup.sh --harnesses` puts them) when it exists.
    #[serde(default)]
    pub harness_dir: Option<std::path::PathBuf>,
    /// Hard cap on an agent run's wall-clock time, seconds (default 7 days); a run past
    /// it (or past its own `timeout_secs`) ends `timed_out`.
    #[serde(default)]
    pub max_run_secs: Option<u64>,
    /// Seconds a cancelled or timed-out run's processes get between SIGTERM and SIGKILL
    /// (default 5, at most 300: a cancel request waits for them; 0 kills at once).
    #[serde(default)]
    pub cancel_grace_secs: Option<u64>,
}

impl AgentsFileConfig {
    /// The cap on a run's wall-clock time; 0 is refused (it would end every run at once).
    pub fn max_run(&self) -> Result<std::time::Duration, ConfigError> {
        match self.max_run_secs {
            None => Ok(sandpit_core::agent_runtime::DEFAULT_MAX_RUN),
            Some(0) => Err(ConfigError::Zero {
                name: "[agents] max_run_secs",
            }),
            Some(s) => Ok(std::time::Duration::from_secs(s)),
        }
    }

    /// The grace period between a cancelled or timed-out run's SIGTERM and SIGKILL.
    pub fn cancel_grace(&self) -> Result<std::time::Duration, ConfigError> {
        let max = sandpit_core::agent_runtime::MAX_CANCEL_GRACE;
        match self.cancel_grace_secs {
            None => Ok(sandpit_core::agent_runtime::DEFAULT_CANCEL_GRACE),
            Some(s) if s <= max.as_secs() => Ok(std::time::Duration::from_secs(s)),
            Some(_) => Err(ConfigError::OutOfRange {
                name: "[agents] cancel_grace_secs",
                min: 0,
                max: max.as_secs(),
            }),
        }
    }

    /// The harness directory to bind: the configured one, else the build tree's if
    /// present; `None` when there is none (agent runtimes are then refused).
    pub fn resolve(&self) -> Result<Option<std::path::PathBuf>, ServerError> {
        if let Some(dir) = &self.harness_dir {
            let dir = dir
                .canonicalize()
                .map_err(|source| ConfigError::HarnessDir {
                    dir: dir.clone(),
                    source,
                })?;
            return Ok(Some(dir));
        }
        let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/harnesses");
        Ok(built.canonicalize().ok().filter(|d| d.is_dir()))
    }
}

impl FileConfig {
    /// Reads `path`; a missing file is an error only when `required`.
    pub fn load(path: &Path, required: bool) -> Result<Self, ServerError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                return Ok(Self::default());
            }
            Err(e) => return Err(ServerError::Io(format!("read {}", path.display()), e)),
        };
        Self::parse(&text).map_err(|source| ServerError::ConfigFile {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses and checks the text of a config file.
    fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: FileConfig = toml::from_str(text)?;
        cfg.proxy.check()?;
        cfg.http.check()?;
        cfg.agents.max_run()?;
        cfg.agents.cancel_grace()?;
        let mut names = std::collections::BTreeSet::new();
        for p in &cfg.pools {
            if !names.insert(p.name.as_str()) {
                return Err(ConfigError::DuplicatePool(p.name.clone()));
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<FileConfig, ServerError> {
        let dir = tempfile::tempdir().map_err(|e| ServerError::Io("tmp".into(), e))?;
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).map_err(|e| ServerError::Io("write".into(), e))?;
        FileConfig::load(&path, true)
    }

    #[test]
    fn pools_parse_with_limits() {
        let cfg = parse(
            r#"
[[pools]]
name = "py"
size = 4
template = "host"
limits = { cpu_millis = 500, memory_bytes = 268435456 }

[[pools]]
name = "small"
size = 1
"#,
        )
        .unwrap();
        assert_eq!(cfg.pools.len(), 2);
        assert_eq!(cfg.pools[0].name, "py");
        assert_eq!(cfg.pools[0].size, 4);
        assert_eq!(cfg.pools[0].limits.cpu_millis, Some(500));
        assert_eq!(cfg.pools[0].limits.memory_bytes, Some(256 << 20));
        assert_eq!(cfg.pools[1].template, None);
    }

    #[test]
    fn proxy_section() {
        let cfg = parse("[proxy]\ndomain = \"sb.example.com\"\nany_domain = false\n").unwrap();
        assert_eq!(cfg.proxy.domain(), "sb.example.com");
        assert!(!cfg.proxy.any_domain);
        assert_eq!(cfg.proxy.scheme, "http");
        let cfg = parse("").unwrap();
        assert!(cfg.proxy.any_domain);
        assert_eq!(cfg.proxy.domain(), crate::ingress::DEFAULT_DOMAIN);
        assert!(parse("[proxy]\ndomian = \"x\"\n").is_err());
        assert!(parse("[proxy]\nscheme = \"ftp\"\n").is_err());
        assert!(parse("[proxy]\ndomain = \"a b\"\n").is_err());
        assert!(parse("[proxy]\ndomain = \"x.test:0\"\n").is_err());
        assert_eq!(
            parse("[proxy]\ndomain = \"x.test:8080\"\n")
                .unwrap()
                .proxy
                .domain(),
            "x.test:8080"
        );
    }

    #[test]
    fn http_section() {
        let cfg = parse("").unwrap();
        assert_eq!(cfg.http, crate::listener::HttpConfig::default());
        let cfg = parse(
            "[http]\nheader_read_timeout_secs = 2\nidle_timeout_secs = 5\n\
             max_connections = 100\nmax_connections_per_ip = 50\n",
        )
        .unwrap();
        assert_eq!(
            (
                cfg.http.header_read_timeout_secs,
                cfg.http.idle_timeout_secs,
                cfg.http.max_connections,
                cfg.http.max_connections_per_ip
            ),
            (2, 5, Some(100), 50)
        );
        // Unset keys keep their defaults.
        let cfg = parse("[http]\nmax_connections_per_ip = 7\n").unwrap();
        assert_eq!(cfg.http.idle_timeout_secs, 60);
        assert!(parse("[http]\nidle_timeout = 5\n").is_err());
        assert!(parse("[http]\nheader_read_timeout_secs = 0\n").is_err());
        assert!(parse("[http]\nmax_connections = 0\n").is_err());
        assert!(parse("[http]\nmax_connections = -1\n").is_err());
    }

    #[test]
    fn typos_duplicates_and_missing_files_are_errors() {
        assert!(parse("[[pool]]\nname = \"x\"\nsize = 1\n").is_err());
        assert!(parse("[[pools]]\nname = \"x\"\nsize = 1\nsze = 2\n").is_err());
        assert!(
            parse("[[pools]]\nname = \"x\"\nsize = 1\n[[pools]]\nname = \"x\"\nsize = 2\n")
                .is_err()
        );
        assert!(parse("[[pools]]\nname = \"x\"\nsize = -1\n").is_err());
        let missing = Path::new("/nonexistent/sandpit.toml");
        assert!(FileConfig::load(missing, true).is_err());
        assert!(FileConfig::load(missing, false).unwrap().pools.is_empty());
    }

    #[test]
    fn a_refused_file_names_its_path_and_keeps_the_cause() {
        use std::error::Error as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[proxy]\nscheme = \"ftp\"\n").unwrap();
        let e = FileConfig::load(&path, true).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "configuration: {}: proxy.scheme must be http or https, not \"ftp\"",
                path.display()
            )
        );
        assert!(matches!(
            e.source().and_then(|s| s.downcast_ref::<ConfigError>()),
            Some(ConfigError::Scheme(s)) if s == "ftp"
        ));
        std::fs::write(
            &path,
            "[[pools]]\nname = \"a\"\nsize = 1\n[[pools]]\nname = \"a\"\nsize = 1\n",
        )
        .unwrap();
        let e = FileConfig::load(&path, true).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "configuration: {}: pool \"a\" is declared twice",
                path.display()
            )
        );
        // toml's own error stays underneath, with its line and column.
        std::fs::write(&path, "[http\n").unwrap();
        let e = FileConfig::load(&path, true).unwrap_err();
        let parse = e
            .source()
            .and_then(|s| s.downcast_ref::<ConfigError>())
            .and_then(|c| match c {
                ConfigError::Parse(t) => Some(t),
                _ => None,
            });
        assert!(parse.is_some_and(|t| t.span().is_some()), "{e}");
        let missing = AgentsFileConfig {
            harness_dir: Some(dir.path().join("none")),
            max_run_secs: None,
            cancel_grace_secs: None,
        }
        .resolve()
        .unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("configuration: [agents] harness_dir "),
            "{missing}"
        );
        assert!(missing.source().is_some());
        // A run cap of zero would end every run at once; the default is 7 days.
        std::fs::write(&path, "[agents]\nmax_run_secs = 0\n").unwrap();
        let e = FileConfig::load(&path, true).unwrap_err();
        assert!(
            e.to_string().contains("max_run_secs must be at least 1"),
            "{e}"
        );
        std::fs::write(&path, "[agents]\nmax_run_secs = 60\n").unwrap();
        let c = FileConfig::load(&path, true).unwrap();
        assert_eq!(
            c.agents.max_run().unwrap(),
            std::time::Duration::from_secs(60)
        );
        assert_eq!(
            AgentsFileConfig::default().max_run().unwrap(),
            sandpit_core::agent_runtime::DEFAULT_MAX_RUN
        );
        // The cancel's grace: 5 s by default, 0 allowed (straight to SIGKILL), no more
        // than a cancel request may wait.
        assert_eq!(
            AgentsFileConfig::default().cancel_grace().unwrap(),
            std::time::Duration::from_secs(5)
        );
        for (secs, want) in [(0, Some(0)), (300, Some(300)), (301, None)] {
            std::fs::write(&path, format!("[agents]\ncancel_grace_secs = {secs}\n")).unwrap();
            match (FileConfig::load(&path, true), want) {
                (Ok(c), Some(w)) => assert_eq!(
                    c.agents.cancel_grace().unwrap(),
                    std::time::Duration::from_secs(w)
                ),
                (Err(e), None) => assert!(
                    e.to_string()
                        .contains("cancel_grace_secs must be between 0 and 300"),
                    "{e}"
                ),
                (got, want) => panic!("{secs}: {got:?}, wanted {want:?}"),
            }
        }
    }
}
