//! The daemon's config file (TOML): warm pools, `[pool_limits]` and the `[lifecycle]`, `[snapshots]`,
//! `[e2b]`, `[proxy]`, `[broker]`, `[network]`, `[http]`, `[tls]` and `[metrics]` sections; flags carry the
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
    /// TLS on the listener (`[tls]`: `cert_file`, `key_file`; off when absent).
    #[serde(default)]
    pub tls: crate::tls::TlsFileConfig,
    /// The per-sandbox metrics history (`[metrics]`: `enabled`, `sample_interval_secs`,
    /// `retention_secs`).
    #[serde(default)]
    pub metrics: sandpit_core::metrics_history::MetricsConfig,
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
    /// Most approvals one run may have pending (default 16, 1 to 1000); an action beyond
    /// that is refused at once.
    pub max_pending_per_run: u32,
}

impl Default for ApprovalsFileConfig {
    fn default() -> Self {
        let core = sandpit_core::approvals::ApprovalsConfig::default();
        ApprovalsFileConfig {
            timeout_secs: core.timeout_secs,
            require_approver_role: core.require_approver_role,
            max_pending_per_run: core.max_pending_per_run,
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
        if !(1..=1000).contains(&self.max_pending_per_run) {
            return Err(ConfigError::OutOfRange {
                name: "approvals.max_pending_per_run",
                min: 1,
                max: 1000,
            });
        }
        Ok(sandpit_core::approvals::ApprovalsConfig {
            timeout_secs: self.timeout_secs,
            require_approver_role: self.require_approver_role,
            max_pending_per_run: self.max_pending_per_run,
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
    /// Events stored per run, the final `truncated` marker included (default 10000).
    #[serde(default)]
    pub max_events_per_run: Option<u64>,
    /// Longest string (or object key) of an event kept whole, bytes (default 16384); a
    /// longer one keeps its head and ends in `…[truncated N bytes]`.
    #[serde(default)]
    pub max_string_bytes: Option<u64>,
    /// Deepest nesting of arrays and objects in an event's payload (default 16).
    #[serde(default)]
    pub max_event_depth: Option<u64>,
    /// Most elements of an array (members of an object) in an event (default 1000).
    #[serde(default)]
    pub max_event_items: Option<u64>,
    /// Largest serialized payload of an event, bytes (default 262144); a larger one is
    /// replaced by a preview.
    #[serde(default)]
    pub max_event_payload_bytes: Option<u64>,
    /// Seconds a cancelled or timed-out run's processes get between SIGTERM and SIGKILL
    /// (default 5, at most 300: a cancel request waits for them; 0 kills at once).
    #[serde(default)]
    pub cancel_grace_secs: Option<u64>,
}

/// Bounds of the `[agents]` event limits: (name, min, max). The minimums leave room for
/// the truncation markers; the maximums keep one run's events, and one event, a size the
/// store and a reader of the events page can hold (and depth within what serde_json
/// parses back: it refuses nesting past 128 levels).
const EVENT_LIMIT_RANGES: [(&str, u64, u64); 5] = [
    ("[agents] max_events_per_run", 2, 1_000_000),
    ("[agents] max_string_bytes", 64, 16 << 20),
    ("[agents] max_event_depth", 2, 64),
    ("[agents] max_event_items", 1, 1_000_000),
    ("[agents] max_event_payload_bytes", 1024, 16 << 20),
];

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

    /// The event limits of every run: the defaults, with each configured one checked
    /// against its range.
    pub fn event_limits(&self) -> Result<sandpit_core::agent_runtime::EventLimits, ConfigError> {
        let mut limits = sandpit_core::agent_runtime::EventLimits::default();
        let [events, string, depth, items, payload] = EVENT_LIMIT_RANGES;
        let checked = |value: Option<u64>, (name, min, max): (&'static str, u64, u64)| match value {
            Some(v) if !(min..=max).contains(&v) => Err(ConfigError::OutOfRange { name, min, max }),
            v => Ok(v),
        };
        // Every maximum fits a usize on the 64-bit hosts the daemon runs on.
        let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        if let Some(v) = checked(self.max_events_per_run, events)? {
            limits.max_events_per_run = v;
        }
        if let Some(v) = checked(self.max_string_bytes, string)? {
            limits.max_string_bytes = size(v);
        }
        if let Some(v) = checked(self.max_event_depth, depth)? {
            limits.max_depth = size(v);
        }
        if let Some(v) = checked(self.max_event_items, items)? {
            limits.max_items = size(v);
        }
        if let Some(v) = checked(self.max_event_payload_bytes, payload)? {
            limits.max_payload_bytes = size(v);
        }
        Ok(limits)
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

/// `[metrics]`: an interval and a retention in range, the retention no shorter than the
/// interval (it would keep nothing).
fn check_metrics(m: &sandpit_core::metrics_history::MetricsConfig) -> Result<(), ConfigError> {
    use sandpit_core::metrics_history::{INTERVAL_RANGE, RETENTION_RANGE};
    let (lo, hi) = INTERVAL_RANGE;
    if !(lo..=hi).contains(&m.sample_interval_secs) {
        return Err(ConfigError::OutOfRange {
            name: "[metrics] sample_interval_secs",
            min: lo,
            max: hi,
        });
    }
    let (lo, hi) = RETENTION_RANGE;
    let lo = lo.max(m.sample_interval_secs);
    if !(lo..=hi).contains(&m.retention_secs) {
        return Err(ConfigError::OutOfRange {
            name: "[metrics] retention_secs",
            min: lo,
            max: hi,
        });
    }
    Ok(())
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
        cfg.agents.event_limits()?;
        cfg.agents.cancel_grace()?;
        check_metrics(&cfg.metrics)?;
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
    fn metrics_section_is_checked() {
        let cfg = parse("").unwrap();
        assert!(cfg.metrics.enabled);
        assert_eq!(
            (cfg.metrics.sample_interval_secs, cfg.metrics.retention_secs),
            (5, 86400)
        );
        let cfg = parse("[metrics]\nsample_interval_secs = 1\nretention_secs = 3\n").unwrap();
        assert_eq!(
            (cfg.metrics.sample_interval_secs, cfg.metrics.retention_secs),
            (1, 3)
        );
        assert!(
            !parse("[metrics]\nenabled = false\n")
                .unwrap()
                .metrics
                .enabled
        );
        for bad in [
            "sample_interval_secs = 0",
            "sample_interval_secs = 3601",
            "retention_secs = 0",
            "retention_secs = 4",
            "retention_secs = 7776001",
            "sample_interval_secs = -1",
            "interval = 5",
        ] {
            let text = format!("[metrics]\n{bad}\n");
            assert!(parse(&text).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn approvals_section_is_checked() {
        let cfg = parse("[approvals]\nmax_pending_per_run = 3\n").unwrap();
        let core = cfg.approvals.resolve().unwrap();
        assert_eq!(core.max_pending_per_run, 3);
        assert_eq!(core.timeout_secs, 300);
        let defaults = parse("").unwrap().approvals.resolve().unwrap();
        assert_eq!(defaults.max_pending_per_run, 16);
        for bad in [
            "max_pending_per_run = 0",
            "max_pending_per_run = 1001",
            "timeout_secs = 0",
        ] {
            let cfg = parse(&format!("[approvals]\n{bad}\n")).unwrap();
            assert!(cfg.approvals.resolve().is_err(), "{bad}");
        }
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
    fn agents_event_limits_default_parse_and_refuse_nonsense() {
        let defaults = sandpit_core::agent_runtime::EventLimits::default();
        assert_eq!(parse("").unwrap().agents.event_limits().unwrap(), defaults);
        assert_eq!(
            parse("[agents]\nmax_run_secs = 60\n")
                .unwrap()
                .agents
                .event_limits()
                .unwrap(),
            defaults
        );
        let cfg = parse(
            "[agents]\nmax_events_per_run = 50\nmax_string_bytes = 100\nmax_event_depth = 4\n\
             max_event_items = 10\nmax_event_payload_bytes = 4096\n",
        )
        .unwrap();
        let l = cfg.agents.event_limits().unwrap();
        assert_eq!(
            (
                l.max_events_per_run,
                l.max_string_bytes,
                l.max_depth,
                l.max_items,
                l.max_payload_bytes
            ),
            (50, 100, 4, 10, 4096)
        );
        // One set, the rest keep their defaults.
        let l = parse("[agents]\nmax_string_bytes = 64\n")
            .unwrap()
            .agents
            .event_limits()
            .unwrap();
        assert_eq!(l.max_string_bytes, 64);
        assert_eq!(l.max_events_per_run, defaults.max_events_per_run);
        // The bounds themselves are accepted.
        for ok in [
            "max_events_per_run = 2",
            "max_events_per_run = 1000000",
            "max_event_depth = 64",
            "max_event_payload_bytes = 16777216",
        ] {
            assert!(parse(&format!("[agents]\n{ok}\n")).is_ok(), "{ok}");
        }
        for (bad, message) in [
            (
                "max_events_per_run = 0",
                "[agents] max_events_per_run must be between 2 and 1000000",
            ),
            (
                "max_events_per_run = 1",
                "[agents] max_events_per_run must be between 2 and 1000000",
            ),
            (
                "max_events_per_run = 1000001",
                "[agents] max_events_per_run must be between 2 and 1000000",
            ),
            (
                "max_string_bytes = 0",
                "[agents] max_string_bytes must be between 64 and 16777216",
            ),
            (
                "max_string_bytes = 18446744073709551615",
                "[agents] max_string_bytes must be between 64 and 16777216",
            ),
            (
                "max_event_depth = 0",
                "[agents] max_event_depth must be between 2 and 64",
            ),
            (
                "max_event_depth = 1000",
                "[agents] max_event_depth must be between 2 and 64",
            ),
            (
                "max_event_items = 0",
                "[agents] max_event_items must be between 1 and 1000000",
            ),
            (
                "max_event_payload_bytes = 10",
                "[agents] max_event_payload_bytes must be between 1024 and 16777216",
            ),
        ] {
            let e = parse(&format!("[agents]\n{bad}\n")).unwrap_err();
            assert!(e.to_string().ends_with(message), "{bad}: {e}");
        }
        // Negative numbers and typos are refused by the parser itself.
        assert!(parse("[agents]\nmax_events_per_run = -1\n").is_err());
        assert!(parse("[agents]\nmax_events = 5\n").is_err());
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
            ..Default::default()
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
