//! Egress policies: validation of what the API accepts, and the decision for one outbound
//! attempt. Pure code; the proxy and the DNS resolver ask it.

use sandpit_api::network::{NetworkMode, NetworkPolicy, NetworkRule, PortSpec, RuleAction};
use std::net::Ipv4Addr;

/// Most rules one policy may have.
pub const MAX_RULES: usize = 256;
/// Most port ranges one rule may have.
pub const MAX_PORT_RANGES: usize = 64;

/// Why a policy, or a `[network]` setting written the same way, is not valid; each
/// variant keeps the offending value. The texts are what API clients are answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A network whose prefix length is not a number up to 32.
    #[error("bad prefix length in {0:?}")]
    PrefixLength(String),
    /// Not an IPv4 address or network.
    #[error("{0:?} is not an IPv4 network (a.b.c.d/len)")]
    NotANetwork(String),
    /// A port range that is not `lo-hi` or a port number.
    #[error("bad port range {0:?} (`lo-hi`, 1..=65535)")]
    PortSyntax(String),
    /// A port range starting at 0 or ending before it starts.
    #[error("bad port range {lo}-{hi} (1..=65535, low first)")]
    PortRange { lo: u16, hi: u16 },
    /// More port ranges than a rule may have.
    #[error("at most {} port ranges per rule", MAX_PORT_RANGES)]
    TooManyPortRanges,
    /// A domain that is neither a host name nor a wildcard.
    #[error("bad domain {0:?}: a host name (`example.com`) or a wildcard (`*.example.com`)")]
    Domain(String),
    /// An address given as a domain.
    #[error("{0:?} is an address: use `cidr` for addresses")]
    DomainIsAddress(String),
    /// More rules than a policy may have.
    #[error("at most {} rules", MAX_RULES)]
    TooManyRules,
    /// A rule selecting nothing.
    #[error("a rule needs a domain, a cidr or ports")]
    EmptyRule,
    /// `override` on a deny rule.
    #[error("`override` is for allow rules")]
    OverrideOnDeny,
    /// A rule name longer than 128 bytes.
    #[error("name is at most 128 bytes")]
    NameTooLong,
    /// What is wrong with rule `index`.
    #[error("rules[{index}]: {source}")]
    Rule {
        index: usize,
        #[source]
        source: Box<PolicyError>,
    },
}

/// An IPv4 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: u32,
    prefix: u8,
}

impl Cidr {
    /// A network from its address and prefix length (host bits are cleared).
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Self {
        let prefix = prefix.min(32);
        Self {
            net: u32::from(addr) & Self::mask_of(prefix),
            prefix,
        }
    }

    fn mask_of(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(prefix))
        }
    }

    /// Parses `a.b.c.d/len` or a single address.
    pub fn parse(s: &str) -> Result<Self, PolicyError> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (
                a,
                l.parse::<u8>()
                    .ok()
                    .filter(|l| *l <= 32)
                    .ok_or_else(|| PolicyError::PrefixLength(s.to_string()))?,
            ),
            None => (s, 32),
        };
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| PolicyError::NotANetwork(s.to_string()))?;
        Ok(Self::new(addr, len))
    }

    /// Whether `ip` lies in the network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask_of(self.prefix) == self.net
    }

    /// The network's first address.
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.net)
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Number of addresses.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    /// Whether the two networks share any address.
    pub fn overlaps(&self, other: &Cidr) -> bool {
        let p = self.prefix.min(other.prefix);
        let m = Self::mask_of(p);
        self.net & m == other.net & m
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

/// Parses a port list of the API (`443`, `"8000-8100"`).
pub fn parse_ports(ports: &[PortSpec]) -> Result<Vec<(u16, u16)>, PolicyError> {
    let mut out = Vec::with_capacity(ports.len());
    for p in ports {
        let (lo, hi) = match p {
            PortSpec::One(n) => (*n, *n),
            PortSpec::Range(s) => {
                let bad = || PolicyError::PortSyntax(s.clone());
                match s.split_once('-') {
                    Some((a, b)) => (
                        a.trim().parse().map_err(|_| bad())?,
                        b.trim().parse().map_err(|_| bad())?,
                    ),
                    None => {
                        let n = s.trim().parse().map_err(|_| bad())?;
                        (n, n)
                    }
                }
            }
        };
        if lo == 0 || lo > hi {
            return Err(PolicyError::PortRange { lo, hi });
        }
        out.push((lo, hi));
    }
    if out.len() > MAX_PORT_RANGES {
        return Err(PolicyError::TooManyPortRanges);
    }
    Ok(out)
}

/// A domain selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DomainPat {
    /// This name only.
    Exact(String),
    /// Any name below this one (stored with its leading dot).
    Below(String),
}

impl DomainPat {
    fn matches(&self, name: &str) -> bool {
        match self {
            DomainPat::Exact(d) => name == d,
            DomainPat::Below(suffix) => {
                name.len() > suffix.len() && name.ends_with(suffix.as_str())
            }
        }
    }
}

/// Lower-cases a host name and drops a trailing dot; None for what is not a host name.
pub fn normalize_name(name: &str) -> Option<String> {
    let n = name.trim_end_matches('.').to_ascii_lowercase();
    let ok = !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    ok.then_some(n)
}

fn parse_domain(d: &str) -> Result<DomainPat, PolicyError> {
    let bad = || PolicyError::Domain(d.to_string());
    let (below, rest) = match d.strip_prefix("*.") {
        Some(r) => (true, r),
        None => (false, d),
    };
    let name = normalize_name(rest).ok_or_else(bad)?;
    if name.parse::<Ipv4Addr>().is_ok() {
        return Err(PolicyError::DomainIsAddress(d.to_string()));
    }
    Ok(if below {
        DomainPat::Below(format!(".{name}"))
    } else {
        DomainPat::Exact(name)
    })
}

#[derive(Debug, Clone)]
struct Rule {
    allow: bool,
    overrides: bool,
    domain: Option<DomainPat>,
    cidr: Option<Cidr>,
    ports: Vec<(u16, u16)>,
    label: String,
}

/// Whether a selector holds: true, false, or not known yet.
fn all_known(parts: &[Option<bool>]) -> Option<bool> {
    let mut unknown = false;
    for p in parts {
        match p {
            Some(false) => return Some(false),
            None => unknown = true,
            Some(true) => {}
        }
    }
    if unknown { None } else { Some(true) }
}

impl Rule {
    /// Whether the rule matches: `None` when it depends on something not known yet.
    fn test(&self, a: &Attempt<'_>) -> Option<bool> {
        let domain = self
            .domain
            .as_ref()
            .map(|d| a.name.map(|n| d.matches(n)).unwrap_or(false));
        let cidr = self.cidr.as_ref().map(|c| a.ip.map(|ip| c.contains(ip)));
        let ports = (!self.ports.is_empty()).then(|| {
            a.port
                .map(|p| self.ports.iter().any(|(lo, hi)| (*lo..=*hi).contains(&p)))
        });
        let parts = [
            domain.map(Some).unwrap_or(Some(true)),
            cidr.unwrap_or(Some(true)),
            ports.unwrap_or(Some(true)),
        ];
        all_known(&parts)
    }
}

fn describe(i: usize, r: &NetworkRule) -> String {
    if let Some(n) = &r.name {
        return format!("rules[{i}] {n:?}");
    }
    let mut s = format!(
        "rules[{i}] {}",
        match r.action {
            RuleAction::Allow => "allow",
            RuleAction::Deny => "deny",
        }
    );
    if let Some(d) = &r.domain {
        s.push(' ');
        s.push_str(d);
    }
    if let Some(c) = &r.cidr {
        s.push(' ');
        s.push_str(c);
    }
    if !r.ports.is_empty() {
        let ports: Vec<String> = r
            .ports
            .iter()
            .map(|p| match p {
                PortSpec::One(n) => n.to_string(),
                PortSpec::Range(s) => s.clone(),
            })
            .collect();
        s.push_str(" port ");
        s.push_str(&ports.join(","));
    }
    if r.overrides {
        s.push_str(" (override)");
    }
    s
}

/// A validated policy, ready to decide.
#[derive(Debug, Clone)]
pub struct Policy {
    /// What the API showed and stores.
    pub source: NetworkPolicy,
    rules: Vec<Rule>,
}

/// What is known of one outbound attempt.
#[derive(Debug, Clone, Copy, Default)]
pub struct Attempt<'a> {
    /// Normalized host name, when there is one.
    pub name: Option<&'a str>,
    pub ip: Option<Ipv4Addr>,
    pub port: Option<u16>,
}

/// A policy's verdict and what decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allow: bool,
    pub rule: String,
}

impl Decision {
    fn new(allow: bool, rule: impl Into<String>) -> Self {
        Self {
            allow,
            rule: rule.into(),
        }
    }
}

impl Policy {
    /// Mode `none`: what a sandbox without a policy of its own gets.
    pub fn none() -> Policy {
        Policy {
            source: NetworkPolicy::default(),
            rules: Vec::new(),
        }
    }

    /// Validates an API policy.
    pub fn compile(p: &NetworkPolicy) -> Result<Policy, PolicyError> {
        if p.rules.len() > MAX_RULES {
            return Err(PolicyError::TooManyRules);
        }
        let mut rules = Vec::with_capacity(p.rules.len());
        for (i, r) in p.rules.iter().enumerate() {
            let at = |e: PolicyError| PolicyError::Rule {
                index: i,
                source: Box::new(e),
            };
            if r.domain.is_none() && r.cidr.is_none() && r.ports.is_empty() {
                return Err(at(PolicyError::EmptyRule));
            }
            if r.overrides && r.action == RuleAction::Deny {
                return Err(at(PolicyError::OverrideOnDeny));
            }
            if r.name.as_ref().is_some_and(|n| n.len() > 128) {
                return Err(at(PolicyError::NameTooLong));
            }
            let domain = r
                .domain
                .as_deref()
                .map(parse_domain)
                .transpose()
                .map_err(at)?;
            let cidr = r.cidr.as_deref().map(Cidr::parse).transpose().map_err(at)?;
            let ports = parse_ports(&r.ports).map_err(at)?;
            rules.push(Rule {
                allow: r.action == RuleAction::Allow,
                overrides: r.overrides,
                domain,
                cidr,
                ports,
                label: describe(i, r),
            });
        }
        Ok(Policy {
            source: p.clone(),
            rules,
        })
    }

    /// The mode.
    pub fn mode(&self) -> NetworkMode {
        self.source.mode
    }

    /// Decides an attempt. Rules that depend on something unknown count for allowing (it
    /// might match) and not for denying: ask again once it is known.
    pub fn decide(&self, a: &Attempt<'_>) -> Decision {
        if self.mode() == NetworkMode::None {
            return Decision::new(false, "mode none");
        }
        let might = |r: &&Rule| r.test(a) != Some(false);
        let does = |r: &&Rule| r.test(a) == Some(true);
        if let Some(r) = self
            .rules
            .iter()
            .filter(|r| r.allow && r.overrides)
            .find(might)
        {
            return Decision::new(true, r.label.clone());
        }
        if let Some(r) = self.rules.iter().filter(|r| !r.allow).find(does) {
            return Decision::new(false, r.label.clone());
        }
        if let Some(r) = self.rules.iter().filter(|r| r.allow).find(might) {
            return Decision::new(true, r.label.clone());
        }
        match self.mode() {
            NetworkMode::Open => Decision::new(true, "mode open"),
            _ => Decision::new(false, "default deny (allowlist)"),
        }
    }

    /// Whether the sandbox's DNS resolver may look `name` up at all. Only rules that name
    /// a domain can make a name resolvable in `allowlist` mode (a rule by address alone
    /// would open DNS to every name, and DNS questions carry data out).
    pub fn name_resolvable(&self, name: &str) -> Decision {
        if self.mode() == NetworkMode::None {
            return Decision::new(false, "mode none");
        }
        let a = Attempt {
            name: Some(name),
            ip: None,
            port: None,
        };
        let by_name = |r: &&Rule| r.domain.is_some() && r.test(&a) != Some(false);
        if let Some(r) = self
            .rules
            .iter()
            .filter(|r| r.allow && r.overrides)
            .find(by_name)
        {
            return Decision::new(true, r.label.clone());
        }
        if let Some(r) = self
            .rules
            .iter()
            .filter(|r| !r.allow)
            .find(|r| r.test(&a) == Some(true))
        {
            return Decision::new(false, r.label.clone());
        }
        if let Some(r) = self.rules.iter().filter(|r| r.allow).find(by_name) {
            return Decision::new(true, r.label.clone());
        }
        match self.mode() {
            NetworkMode::Open => Decision::new(true, "mode open"),
            _ => Decision::new(false, "default deny (allowlist)"),
        }
    }
}

/// Ranges no sandbox reaches unless the operator allows them, with the reason audited.
const BLOCKED: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this network"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private range"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared address space (CGNAT)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private range"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignments"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private range"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking range"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
];

/// An operator's exception to the always-blocked ranges.
#[derive(Debug, Clone)]
pub struct OperatorAllow {
    pub cidr: Cidr,
    /// Any port when empty.
    pub ports: Vec<(u16, u16)>,
}

/// Why an address is out of every sandbox's reach, if it is. `host` holds the host's own
/// addresses and the networks its links are on.
pub fn blocked(
    ip: Ipv4Addr,
    port: Option<u16>,
    sandbox_net: &Cidr,
    host_addrs: &[Ipv4Addr],
    host_nets: &[Cidr],
    allowed: &[OperatorAllow],
) -> Option<&'static str> {
    let excepted = allowed.iter().any(|a| {
        a.cidr.contains(ip)
            && (a.ports.is_empty()
                || port.is_none_or(|p| a.ports.iter().any(|(lo, hi)| (*lo..=*hi).contains(&p))))
    });
    if excepted {
        return None;
    }
    if sandbox_net.contains(ip) {
        return Some("sandbox network (other sandboxes and the daemon)");
    }
    if let Some((_, _, why)) = BLOCKED
        .iter()
        .find(|(net, len, _)| Cidr::new(*net, *len).contains(ip))
    {
        return Some(why);
    }
    if host_addrs.contains(&ip) {
        return Some("host address");
    }
    if host_nets.iter().any(|n| n.contains(ip)) {
        return Some("host's local network");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(action: RuleAction) -> NetworkRule {
        NetworkRule {
            action,
            domain: None,
            cidr: None,
            ports: vec![],
            overrides: false,
            name: None,
        }
    }

    fn policy(mode: NetworkMode, rules: Vec<NetworkRule>) -> Policy {
        Policy::compile(&NetworkPolicy { mode, rules }).unwrap()
    }

    fn at<'a>(name: Option<&'a str>, ip: &str, port: u16) -> Attempt<'a> {
        Attempt {
            name,
            ip: Some(ip.parse().unwrap()),
            port: Some(port),
        }
    }

    #[test]
    fn domains_wildcards_cidrs_and_ports() {
        let p = policy(
            NetworkMode::Allowlist,
            vec![
                NetworkRule {
                    domain: Some("Example.COM.".into()),
                    ..rule(RuleAction::Allow)
                },
                NetworkRule {
                    domain: Some("*.svc.test".into()),
                    ports: vec![PortSpec::One(443)],
                    ..rule(RuleAction::Allow)
                },
                NetworkRule {
                    cidr: Some("203.0.113.0/28".into()),
                    ports: vec![PortSpec::Range("8000-8100".into())],
                    ..rule(RuleAction::Allow)
                },
            ],
        );
        let ip = "203.0.113.50";
        assert!(p.decide(&at(Some("example.com"), ip, 80)).allow);
        assert!(!p.decide(&at(Some("www.example.com"), ip, 80)).allow);
        assert!(p.decide(&at(Some("a.svc.test"), ip, 443)).allow);
        assert!(p.decide(&at(Some("a.b.svc.test"), ip, 443)).allow);
        assert!(!p.decide(&at(Some("svc.test"), ip, 443)).allow);
        assert!(!p.decide(&at(Some("a.svc.test"), ip, 80)).allow);
        assert!(!p.decide(&at(Some("xsvc.test"), ip, 443)).allow);
        assert!(p.decide(&at(None, "203.0.113.5", 8080)).allow);
        assert!(!p.decide(&at(None, "203.0.113.16", 8080)).allow);
        assert!(!p.decide(&at(None, "203.0.113.5", 7999)).allow);
        let d = p.decide(&at(None, "198.51.100.1", 80));
        assert_eq!(d.rule, "default deny (allowlist)");
        assert_eq!(
            p.decide(&at(Some("a.svc.test"), ip, 443)).rule,
            "rules[1] allow *.svc.test port 443"
        );
        // A name is resolvable when a domain rule could allow it; an address rule alone
        // never makes names resolvable.
        assert!(p.name_resolvable("a.svc.test").allow);
        assert!(!p.name_resolvable("other.test").allow);
    }

    #[test]
    fn deny_wins_unless_the_allow_overrides() {
        let mut rules = vec![
            NetworkRule {
                domain: Some("*.example.com".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                domain: Some("secret.example.com".into()),
                ..rule(RuleAction::Deny)
            },
            NetworkRule {
                ports: vec![PortSpec::One(25)],
                ..rule(RuleAction::Deny)
            },
        ];
        let p = policy(NetworkMode::Open, rules.clone());
        let ip = "203.0.113.1";
        assert!(p.decide(&at(Some("www.example.com"), ip, 443)).allow);
        let d = p.decide(&at(Some("secret.example.com"), ip, 443));
        assert!(!d.allow);
        assert_eq!(d.rule, "rules[1] deny secret.example.com");
        assert!(!p.decide(&at(Some("www.example.com"), ip, 25)).allow);
        assert!(p.decide(&at(Some("anything.test"), ip, 80)).allow);
        assert!(!p.name_resolvable("secret.example.com").allow);
        // A port deny does not keep the name from resolving.
        assert!(p.name_resolvable("www.example.com").allow);
        rules.push(NetworkRule {
            domain: Some("secret.example.com".into()),
            ports: vec![PortSpec::One(443)],
            overrides: true,
            name: Some("the exception".into()),
            ..rule(RuleAction::Allow)
        });
        let p = policy(NetworkMode::Open, rules);
        let d = p.decide(&at(Some("secret.example.com"), ip, 443));
        assert!(d.allow);
        assert_eq!(d.rule, "rules[3] \"the exception\"");
        assert!(!p.decide(&at(Some("secret.example.com"), ip, 80)).allow);
        assert!(p.name_resolvable("secret.example.com").allow);
    }

    #[test]
    fn mode_none_denies_everything() {
        let p = policy(
            NetworkMode::None,
            vec![NetworkRule {
                cidr: Some("0.0.0.0/0".into()),
                overrides: true,
                ..rule(RuleAction::Allow)
            }],
        );
        let d = p.decide(&at(None, "203.0.113.1", 80));
        assert_eq!(d, Decision::new(false, "mode none"));
        assert!(!p.name_resolvable("example.com").allow);
    }

    #[test]
    fn bad_policies_are_refused() {
        for r in [
            rule(RuleAction::Allow),
            NetworkRule {
                domain: Some("*".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                domain: Some("a..b".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                domain: Some("10.0.0.1".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                domain: Some("exa mple.com".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                cidr: Some("10.0.0.0/33".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                cidr: Some("2001:db8::/32".into()),
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                ports: vec![PortSpec::One(0)],
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                ports: vec![PortSpec::Range("90-80".into())],
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                ports: vec![PortSpec::Range("x".into())],
                ..rule(RuleAction::Allow)
            },
            NetworkRule {
                domain: Some("a.com".into()),
                overrides: true,
                ..rule(RuleAction::Deny)
            },
        ] {
            let p = NetworkPolicy {
                mode: NetworkMode::Allowlist,
                rules: vec![r.clone()],
            };
            assert!(Policy::compile(&p).is_err(), "{r:?} was accepted");
        }
        let many = NetworkPolicy {
            mode: NetworkMode::Open,
            rules: vec![
                NetworkRule {
                    ports: vec![PortSpec::One(1)],
                    ..rule(RuleAction::Deny)
                };
                MAX_RULES + 1
            ],
        };
        assert!(Policy::compile(&many).is_err());
    }

    #[test]
    fn always_blocked_ranges_and_operator_exceptions() {
        let sandboxes = Cidr::parse("10.200.0.0/16").unwrap();
        let host = ["192.0.2.2".parse().unwrap()];
        let nets = [Cidr::parse("192.0.2.0/24").unwrap()];
        let b = |ip: &str, allowed: &[OperatorAllow]| {
            blocked(
                ip.parse().unwrap(),
                Some(80),
                &sandboxes,
                &host,
                &nets,
                allowed,
            )
        };
        for ip in [
            "169.254.169.254",
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "10.200.0.1",
            "192.0.2.2",
            "192.0.2.1",
            "224.0.0.1",
            "255.255.255.255",
            "0.0.0.0",
        ] {
            assert!(b(ip, &[]).is_some(), "{ip} is not blocked");
        }
        assert_eq!(b("169.254.169.254", &[]), Some("link-local"));
        assert_eq!(b("192.0.2.1", &[]), Some("host's local network"));
        assert_eq!(b("203.0.113.9", &[]), None);
        assert_eq!(b("198.51.100.9", &[]), None);
        let allow = [OperatorAllow {
            cidr: Cidr::parse("10.1.0.0/16").unwrap(),
            ports: vec![(80, 80)],
        }];
        assert_eq!(b("10.1.2.3", &allow), None);
        assert!(
            blocked(
                "10.1.2.3".parse().unwrap(),
                Some(81),
                &sandboxes,
                &host,
                &nets,
                &allow
            )
            .is_some()
        );
    }

    #[test]
    fn cidr_arithmetic() {
        let c = Cidr::parse("10.200.7.9/16").unwrap();
        assert_eq!(c.to_string(), "10.200.0.0/16");
        assert_eq!(c.size(), 65536);
        assert!(c.overlaps(&Cidr::parse("10.0.0.0/8").unwrap()));
        assert!(c.overlaps(&Cidr::parse("10.200.3.0/24").unwrap()));
        assert!(!c.overlaps(&Cidr::parse("10.201.0.0/16").unwrap()));
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains("1.2.3.4".parse().unwrap())
        );
    }

    #[test]
    fn policy_errors_name_the_offending_value_and_keep_the_rule_cause() {
        use std::error::Error as _;
        assert_eq!(
            Cidr::parse("10.0.0.0/33").unwrap_err().to_string(),
            "bad prefix length in \"10.0.0.0/33\""
        );
        assert_eq!(
            Cidr::parse("nope").unwrap_err(),
            PolicyError::NotANetwork("nope".into())
        );
        assert_eq!(
            parse_ports(&[PortSpec::Range("9-x".into())])
                .unwrap_err()
                .to_string(),
            "bad port range \"9-x\" (`lo-hi`, 1..=65535)"
        );
        assert_eq!(
            parse_ports(&[PortSpec::Range("90-80".into())])
                .unwrap_err()
                .to_string(),
            "bad port range 90-80 (1..=65535, low first)"
        );
        assert_eq!(
            parse_ports(&vec![PortSpec::One(1); MAX_PORT_RANGES + 1])
                .unwrap_err()
                .to_string(),
            "at most 64 port ranges per rule"
        );
        let p = NetworkPolicy {
            mode: NetworkMode::Allowlist,
            rules: vec![
                NetworkRule {
                    domain: Some("ok.example".into()),
                    ..rule(RuleAction::Allow)
                },
                NetworkRule {
                    domain: Some("1.2.3.4".into()),
                    ..rule(RuleAction::Allow)
                },
            ],
        };
        let e = Policy::compile(&p).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rules[1]: \"1.2.3.4\" is an address: use `cidr` for addresses"
        );
        let cause = e.source().expect("the rule's error keeps its cause");
        assert_eq!(
            cause.to_string(),
            "\"1.2.3.4\" is an address: use `cidr` for addresses"
        );
        assert!(PolicyError::TooManyRules.source().is_none());
        assert_eq!(PolicyError::TooManyRules.to_string(), "at most 256 rules");
    }
}
