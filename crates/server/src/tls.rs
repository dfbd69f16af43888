//! TLS on the daemon's own listener, and the local CA that `sandpit tls init` makes.
//!
//! Off by default: plain HTTP stays the daemon's protocol until a certificate and key are
//! given (`--tls-cert`/`--tls-key`, or `[tls]` in the config file). Then the one listener
//! speaks TLS only (ALPN `h2` and `http/1.1`), URLs handed out say `https`, and the
//! connection's SNI name travels with each request ([`ConnInfo`]) so that the ingress can
//! refuse a request whose host names another sandbox than the connection was opened for
//! ([`check_names`]).
//!
//! The key file is opened without following a symlink and must be a regular file of the
//! daemon's user (or root) that nobody else may read or write (mode `0600` or stricter):
//! a key others can read is no secret, and the daemon says so rather than serve with it.
//!
//! [`init`] makes a CA that can only sign names under one domain (an X.509 name
//! constraint), a certificate for `D` and `*.D` signed by it, and writes both with the
//! leaf's key (`0600`); the CA's own key is never written, so the CA signs nothing else
//! once the command has ended.

use crate::ingress::{ProxyConfig, Route};
use axum::response::Response;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest certificate or key file read (real ones are a few KB).
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// Days the certificate of [`init`] is valid: under the 398 days that Apple's and
/// Chrome's clients accept for a server certificate.
pub const LEAF_DAYS: i64 = 397;
/// Years the CA of [`init`] is valid.
pub const CA_YEARS: i64 = 10;

/// File names [`init`] writes in its directory.
pub const CA_FILE: &str = "ca.pem";
/// The certificate chain the daemon presents (leaf, then the CA).
pub const CERT_FILE: &str = "cert.pem";
/// The certificate's private key (mode 0600).
pub const KEY_FILE: &str = "key.pem";

/// Why TLS cannot be set up, or a certificate not made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Only one of the certificate and the key was given.
    #[error(
        "TLS needs both a certificate and a key (--tls-cert and --tls-key, or [tls] cert_file and key_file)"
    )]
    Incomplete,
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The key file is not a regular file.
    #[error("{} is not a regular file", path.display())]
    NotRegular { path: PathBuf },
    /// The key file's mode lets others read or write it.
    #[error("{} has mode {mode:04o}: a TLS key must be readable by its owner only (chmod 600 {})", path.display(), path.display())]
    KeyPermissions { path: PathBuf, mode: u32 },
    /// The key file belongs to another user than the daemon's (or root).
    #[error("{} belongs to uid {uid}: a TLS key must belong to the daemon's user or root (chown)", path.display())]
    KeyOwner { path: PathBuf, uid: u32 },
    /// A file is larger than any certificate or key.
    #[error("{} is larger than {MAX_PEM_BYTES} bytes: not a PEM certificate or key", path.display())]
    TooLarge { path: PathBuf },
    /// The certificate file holds no PEM certificate.
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate { path: PathBuf },
    /// The certificate file holds something that is not a PEM certificate.
    #[error("{}: {source}", path.display())]
    BadCertificate {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The key file holds no usable private key.
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {source}", path.display())]
    BadKey {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// rustls refused the pair (a key that does not match the certificate, say).
    #[error("the certificate and key cannot be used: {0}")]
    Rustls(#[from] rustls::Error),
    /// `tls init` was given a name that cannot be a wildcard certificate's domain.
    #[error("{0:?} is not a usable domain: {1}")]
    Domain(String, &'static str),
    /// Making a certificate failed.
    #[error("cannot make the certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// `tls init` would overwrite a file.
    #[error("{} exists: pass --force to replace it (clients trusting the old CA must trust the new one)", path.display())]
    Exists { path: PathBuf },
    /// Writing a file failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `[tls]` in the config file: the daemon's certificate and key (PEM). Flags win.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFileConfig {
    /// Certificate chain, leaf first (`tls init` writes `cert.pem`).
    pub cert_file: Option<PathBuf>,
    /// Its private key; mode 0600 or stricter.
    pub key_file: Option<PathBuf>,
}

/// A certificate and key to serve with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

/// The files to serve with: the flags' pair, else the config file's; `None` for plain
/// HTTP. Half a pair is refused.
pub fn resolve(
    cert_flag: Option<&Path>,
    key_flag: Option<&Path>,
    file: &TlsFileConfig,
) -> Result<Option<TlsFiles>, TlsError> {
    let pair = if cert_flag.is_some() || key_flag.is_some() {
        (
            cert_flag.map(Path::to_path_buf),
            key_flag.map(Path::to_path_buf),
        )
    } else {
        (file.cert_file.clone(), file.key_file.clone())
    };
    match pair {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
        _ => Err(TlsError::Incomplete),
    }
}

/// Reads a file of at most [`MAX_PEM_BYTES`] through an open descriptor, after `check`
/// has passed on that descriptor's metadata (no window between check and read).
fn read_checked(
    path: &Path,
    check: impl FnOnce(&std::fs::Metadata) -> Result<(), TlsError>,
) -> Result<Vec<u8>, TlsError> {
    let read_err = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(read_err)?;
    let meta = f.metadata().map_err(read_err)?;
    if !meta.file_type().is_file() {
        return Err(TlsError::NotRegular {
            path: path.to_path_buf(),
        });
    }
    check(&meta)?;
    if meta.len() > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    let mut buf = Vec::new();
    f.by_ref()
        .take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(read_err)?;
    if buf.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(buf)
}

/// Reads a private key file, refusing one that others may read or write or that belongs
/// to another user (a symlink is not followed).
pub fn read_key_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    let euid = nix::unistd::geteuid().as_raw();
    read_checked(path, |meta| {
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(TlsError::KeyPermissions {
                path: path.to_path_buf(),
                mode,
            });
        }
        if meta.uid() != euid && meta.uid() != 0 {
            return Err(TlsError::KeyOwner {
                path: path.to_path_buf(),
                uid: meta.uid(),
            });
        }
        Ok(())
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The rustls settings for `files`: their certificate chain and key, ALPN `h2` and
/// `http/1.1`, TLS 1.2 and 1.3.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let cert_pem = read_checked(&files.cert, |_| Ok(()))?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCertificate {
            path: files.cert.clone(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: files.cert.clone(),
        });
    }
    let key_pem = read_key_file(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|source| TlsError::BadKey {
        path: files.key.clone(),
        source,
    })?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// What the listener knows of a TLS connection, in the extensions of each request on it.
#[derive(Debug, Clone, Default)]
pub struct ConnInfo {
    /// The server name the client asked for in its handshake (lowercase), if any.
    pub sni: Option<Arc<str>>,
}

/// The lowercase host name a request is addressed to (URI authority, else `Host`),
/// without port or trailing dot.
fn request_host(headers: &http::HeaderMap, uri: &http::Uri) -> Option<String> {
    let raw = match uri.authority() {
        Some(a) => a.as_str().to_string(),
        None => headers.get(http::header::HOST)?.to_str().ok()?.to_string(),
    };
    let h = raw.rsplit_once('@').map_or(raw.as_str(), |(_, h)| h);
    let h = if h.starts_with('[') {
        h
    } else {
        h.rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            .map_or(h, |(h, _)| h)
    };
    Some(h.trim_end_matches('.').to_ascii_lowercase())
}

/// Refuses (421 Misdirected Request) a request for a sandbox port whose names disagree:
/// on TLS, a host other than the connection's SNI name (a client may not open a
/// connection for one sandbox's name and send it another's); and, on any connection, an
/// `E2b-Sandbox-Id`/`-Port` pair that names another sandbox port than the host does.
/// A client that coalesced connections gets the status HTTP/2 defines for retrying on a
/// fresh one.
#[allow(clippy::result_large_err)]
pub fn check_names(
    info: Option<&ConnInfo>,
    headers: &http::HeaderMap,
    uri: &http::Uri,
    route: &Route,
    cfg: &ProxyConfig,
) -> Result<(), Response> {
    let host = request_host(headers, uri);
    if let Some(sni) = info.and_then(|i| i.sni.as_deref())
        && host.as_deref() != Some(sni)
    {
        return Err(misdirected(
            format!(
                "this TLS connection was opened for {sni}; a request for {} needs its own connection",
                host.as_deref().unwrap_or("another host")
            ),
            route,
        ));
    }
    if !route.by_host
        && let Some(by_host) = crate::ingress::host_route(headers, uri, cfg)
        && (by_host.sandbox_id != route.sandbox_id || by_host.port != route.port)
    {
        return Err(misdirected(
            format!(
                "the host names port {} of sandbox {}, the E2b-Sandbox-Id/E2b-Sandbox-Port headers port {} of sandbox {}",
                by_host.port, by_host.sandbox_id, route.port, route.sandbox_id
            ),
            route,
        ));
    }
    Ok(())
}

fn misdirected(message: String, route: &Route) -> Response {
    crate::ingress::error_body(
        http::StatusCode::MISDIRECTED_REQUEST,
        message,
        Some(&route.sandbox_id),
        Some(route.port),
    )
}

/// What `/files` without a sandbox (envd's file route reached on the API's address) is
/// told: E2B's SDKs build `download_url()`/`upload_url()` from `E2B_SANDBOX_URL` when it
/// is set, and such a URL carries no sandbox id.
pub const UNROUTED_FILES: &str = "this /files URL names no sandbox: it was built from E2B_SANDBOX_URL \
(the E2B SDK's download_url()/upload_url() do that when it is set), and a plain URL carries no sandbox id. \
Use the host form instead: unset E2B_SANDBOX_URL and set E2B_DOMAIN to the daemon's [proxy] domain, \
served over TLS (`sandpit tls init --domain D` makes a certificate; see the README, \"The host form over TLS\"); \
or send the headers E2b-Sandbox-Id: <sandbox id> and E2b-Sandbox-Port: 49983 with the request";

/// A 400 naming the fix, for a `/files` request that reached the API (no sandbox named).
pub fn unrouted_files(uri: &http::Uri) -> Option<Response> {
    (uri.path() == "/files").then(|| {
        crate::ingress::error_body(http::StatusCode::BAD_REQUEST, UNROUTED_FILES, None, None)
    })
}

/// Checks that `domain` can carry a wildcard certificate that clients accept: a DNS name
/// of at least two labels (OpenSSL refuses `*.tld`), not an IP address, not too long for
/// `{port}-{id}.` in front of it.
pub fn check_domain(domain: &str) -> Result<String, TlsError> {
    let bad = |why| Err(TlsError::Domain(domain.to_string(), why));
    let d = domain.trim_end_matches('.').to_ascii_lowercase();
    // "65535-" + a 20-character id + "." must still fit in a 253-character name.
    if d.is_empty() || d.len() > 200 {
        return bad("a domain has 1 to 200 characters");
    }
    let labels: Vec<&str> = d.split('.').collect();
    if labels.len() < 2 {
        return bad(
            "a wildcard certificate needs at least two labels (sandboxes.example.com, not com)",
        );
    }
    for l in &labels {
        if l.is_empty()
            || l.len() > 63
            || l.starts_with('-')
            || l.ends_with('-')
            || !l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return bad("each label has 1 to 63 letters, digits or inner hyphens, and no port");
        }
    }
    if labels
        .last()
        .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return bad("an IP address cannot have subdomains");
    }
    Ok(d)
}

/// Where [`init`] wrote its files.
#[derive(Debug, Clone)]
pub struct InitFiles {
    /// The domain, normalised.
    pub domain: String,
    /// The CA certificate clients trust.
    pub ca: PathBuf,
    /// The chain the daemon presents.
    pub cert: PathBuf,
    /// The daemon's key (0600).
    pub key: PathBuf,
}

/// Makes a CA limited to `domain` and a certificate for `domain` and `*.domain` signed by
/// it, and writes `ca.pem`, `cert.pem` and `key.pem` (0600) into `out` (made 0700 if
/// missing). Existing files are replaced only with `force`; each file is written beside
/// its place and renamed over it, so a reader never sees half of one.
pub fn init(domain: &str, out: &Path, force: bool) -> Result<InitFiles, TlsError> {
    let domain = check_domain(domain)?;
    let files = InitFiles {
        ca: out.join(CA_FILE),
        cert: out.join(CERT_FILE),
        key: out.join(KEY_FILE),
        domain: domain.clone(),
    };
    if !force {
        for p in [&files.ca, &files.cert, &files.key] {
            if std::fs::symlink_metadata(p).is_ok() {
                return Err(TlsError::Exists { path: p.clone() });
            }
        }
    }
    let now = time::OffsetDateTime::now_utc();
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "sandpit");
    dn.push(DnType::CommonName, format!("sandpit local CA for {domain}"));
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    // A client that trusts this CA trusts it for this domain and its subdomains only.
    ca.name_constraints = Some(NameConstraints {
        permitted_subtrees: vec![GeneralSubtree::DnsName(domain.clone())],
        excluded_subtrees: vec![],
    });
    ca.not_before = now - time::Duration::hours(1);
    ca.not_after = now + time::Duration::days(365 * CA_YEARS);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(vec![domain.clone(), format!("*.{domain}")])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("*.{domain}"));
    leaf.distinguished_name = dn;
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = now - time::Duration::hours(1);
    leaf.not_after = now + time::Duration::days(LEAF_DAYS);
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
    drop(issuer);

    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(out)
            .map_err(|source| TlsError::Write {
                path: out.to_path_buf(),
                source,
            })?;
    }
    // Absolute paths: the printed instructions are copied into other directories' shells.
    let out = std::fs::canonicalize(out).map_err(|source| TlsError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    let files = InitFiles {
        ca: out.join(CA_FILE),
        cert: out.join(CERT_FILE),
        key: out.join(KEY_FILE),
        ..files
    };
    let chain = format!("{}{}", leaf_cert.pem(), ca_cert.pem());
    write_replacing(&files.key, leaf_key.serialize_pem().as_bytes(), 0o600)?;
    write_replacing(&files.cert, chain.as_bytes(), 0o644)?;
    write_replacing(&files.ca, ca_cert.pem().as_bytes(), 0o644)?;
    Ok(files)
}

/// Writes `bytes` to a new file beside `path` with `mode` from its creation (never wider
/// for a moment), then renames it over `path`.
fn write_replacing(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(())
}

/// What `sandpit tls init` prints: the files, how to serve with them, the DNS record a
/// team needs, and how each kind of client trusts the CA.
pub fn instructions(f: &InitFiles) -> String {
    let d = &f.domain;
    let (ca, cert, key) = (f.ca.display(), f.cert.display(), f.key.display());
    format!(
        "Wrote:
  {ca}  the local CA: clients trust this (it can sign names under {d} only; its key was not kept)
  {cert}  the certificate for {d} and *.{d}, valid {LEAF_DAYS} days
  {key}  its private key (mode 0600; the daemon refuses it if others may read it)

Serve with TLS (plain HTTP stays the default without these):
  sandpit serve --listen 0.0.0.0:443 --tls-cert {cert} --tls-key {key}
and in the daemon's config.toml, so that sandbox URLs are https://PORT-ID.{d}:
  [proxy]
  domain = \"{d}\"        # \"{d}:8443\" when the daemon listens on another port than 443

DNS: every sandbox port has its own name under {d}; one wildcard record serves them all:
  *.{d}.  A  <the daemon's IP address>
  {d}.    A  <the daemon's IP address>     (optional: the API under the bare name)

Trust the CA on each client:
  Debian/Ubuntu:  cp {ca} /usr/local/share/ca-certificates/sandpit-{d}.crt && update-ca-certificates
  Python (the E2B SDK, httpx, requests):
                  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
                  (the system bundle, after update-ca-certificates; or {ca} to trust this CA alone)
  Node (the npm e2b SDK):
                  export NODE_EXTRA_CA_CERTS={ca}

Then point the E2B SDKs at the host form (no E2B_SANDBOX_URL):
  export E2B_DOMAIN={d} E2B_API_URL=https://api.{d}    # add :PORT to both when not 443
  unset E2B_SANDBOX_URL
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn cfg() -> ProxyConfig {
        ProxyConfig {
            domain: Some("sb.example.test:8443".into()),
            ..Default::default()
        }
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbb";

    fn req(host: &str, headers: &[(&'static str, &str)]) -> (http::HeaderMap, http::Uri) {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::HOST, host.parse().unwrap());
        for (k, v) in headers {
            h.insert(*k, v.parse().unwrap());
        }
        (h, "/files".parse().unwrap())
    }

    fn routed(h: &http::HeaderMap, u: &http::Uri) -> Route {
        crate::ingress::route_of(h, u, &cfg()).unwrap().unwrap()
    }

    fn sni(name: &str) -> ConnInfo {
        ConnInfo {
            sni: Some(Arc::from(name)),
        }
    }

    #[test]
    fn sni_must_name_the_requested_host() {
        let host = format!("8000-{A}.sb.example.test:8443");
        let (h, u) = req(&host, &[]);
        let r = routed(&h, &u);
        let own = sni(&format!("8000-{A}.sb.example.test"));
        assert!(check_names(Some(&own), &h, &u, &r, &cfg()).is_ok());
        // The same connection, another sandbox's (or another port's) name: refused.
        for other in [
            format!("8000-{B}.sb.example.test"),
            format!("8001-{A}.sb.example.test"),
            "api.sb.example.test".to_string(),
        ] {
            let resp = check_names(Some(&sni(&other)), &h, &u, &r, &cfg()).unwrap_err();
            assert_eq!(
                resp.status(),
                http::StatusCode::MISDIRECTED_REQUEST,
                "{other}"
            );
        }
        // Plain HTTP, or TLS without SNI (a client that dialled an address): the host alone.
        assert!(check_names(None, &h, &u, &r, &cfg()).is_ok());
        assert!(check_names(Some(&ConnInfo::default()), &h, &u, &r, &cfg()).is_ok());
    }

    #[test]
    fn headers_must_agree_with_the_host() {
        let host = format!("49983-{A}.sb.example.test");
        let agree = req(
            &host,
            &[("e2b-sandbox-id", A), ("e2b-sandbox-port", "49983")],
        );
        let r = routed(&agree.0, &agree.1);
        assert!(!r.by_host);
        assert!(check_names(None, &agree.0, &agree.1, &r, &cfg()).is_ok());
        for (id, port) in [(B, "49983"), (A, "8000")] {
            let (h, u) = req(&host, &[("e2b-sandbox-id", id), ("e2b-sandbox-port", port)]);
            let r = routed(&h, &u);
            let resp = check_names(None, &h, &u, &r, &cfg()).unwrap_err();
            assert_eq!(resp.status(), http::StatusCode::MISDIRECTED_REQUEST);
        }
        // The header form on the API's own name (E2B_SANDBOX_URL) names no sandbox by host.
        let (h, u) = req(
            "127.0.0.1:8443",
            &[("e2b-sandbox-id", B), ("e2b-sandbox-port", "49983")],
        );
        let r = routed(&h, &u);
        assert!(check_names(Some(&ConnInfo::default()), &h, &u, &r, &cfg()).is_ok());
    }

    #[test]
    fn domains() {
        assert_eq!(
            check_domain("Sandboxes.Example.com.").unwrap(),
            "sandboxes.example.com"
        );
        for bad in [
            "",
            "com",
            "localhost",
            "a..b",
            "-a.b",
            "a-.b",
            "a.b:443",
            "a_b.c",
            "10.0.0.1",
            "*.a.b",
            &"a.".repeat(120),
        ] {
            assert!(check_domain(bad).is_err(), "{bad}");
        }
    }

    fn files(dir: &Path) -> TlsFiles {
        TlsFiles {
            cert: dir.join(CERT_FILE),
            key: dir.join(KEY_FILE),
        }
    }

    #[test]
    fn init_writes_a_usable_pair_with_safe_modes() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tls");
        let f = init("sb.example.test", &out, false).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&f.key), 0o600);
        assert_eq!(mode(&f.cert), 0o644);
        assert_eq!(mode(&f.ca), 0o644);
        // Nothing but the three files (no CA key, no temporary left behind).
        let mut names: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [CA_FILE, CERT_FILE, KEY_FILE]);
        assert!(server_config(&files(&out)).is_ok());
        // A second run does not overwrite without --force, and makes a new pair with it.
        assert!(matches!(
            init("sb.example.test", &out, false),
            Err(TlsError::Exists { .. })
        ));
        let before = std::fs::read(&f.key).unwrap();
        init("sb.example.test", &out, true).unwrap();
        assert_ne!(std::fs::read(&f.key).unwrap(), before);
        assert_eq!(mode(&f.key), 0o600);
        let text = instructions(&f);
        for want in [
            "*.sb.example.test.  A",
            "update-ca-certificates",
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS",
            "--tls-key",
        ] {
            assert!(text.contains(want), "{want} missing from:\n{text}");
        }
    }

    #[test]
    fn a_key_others_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = init("sb.example.test", dir.path(), false).unwrap();
        for mode in [0o640, 0o604, 0o660, 0o602] {
            std::fs::set_permissions(&f.key, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = server_config(&files(dir.path())).unwrap_err();
            assert!(
                matches!(e, TlsError::KeyPermissions { .. }),
                "{mode:o}: {e}"
            );
            assert!(e.to_string().contains("chmod 600"), "{e}");
        }
        std::fs::set_permissions(&f.key, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(server_config(&files(dir.path())).is_ok());
        // A symlink to the key is not followed.
        let link = dir.path().join("link.pem");
        std::os::unix::fs::symlink(&f.key, &link).unwrap();
        let e = server_config(&TlsFiles {
            cert: f.cert.clone(),
            key: link,
        })
        .unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");
        // A directory is not a key.
        let e = read_key_file(dir.path()).unwrap_err();
        assert!(
            matches!(e, TlsError::Read { .. } | TlsError::NotRegular { .. }),
            "{e}"
        );
    }

    #[test]
    fn a_key_of_another_pair_or_garbage_is_refused() {
        let one = tempfile::tempdir().unwrap();
        let two = tempfile::tempdir().unwrap();
        init("sb.example.test", one.path(), false).unwrap();
        init("sb.example.test", two.path(), false).unwrap();
        let mixed = TlsFiles {
            cert: one.path().join(CERT_FILE),
            key: two.path().join(KEY_FILE),
        };
        assert!(matches!(server_config(&mixed), Err(TlsError::Rustls(_))));
        std::fs::write(one.path().join(CERT_FILE), "not pem").unwrap();
        assert!(matches!(
            server_config(&files(one.path())),
            Err(TlsError::NoCertificate { .. })
        ));
    }

    #[test]
    fn half_a_pair_is_refused_and_flags_win() {
        let file = TlsFileConfig {
            cert_file: Some("/f/cert".into()),
            key_file: Some("/f/key".into()),
        };
        assert_eq!(
            resolve(None, None, &file).unwrap().unwrap().cert,
            PathBuf::from("/f/cert")
        );
        let flags = resolve(Some(Path::new("/c")), Some(Path::new("/k")), &file)
            .unwrap()
            .unwrap();
        assert_eq!(flags.key, PathBuf::from("/k"));
        assert!(matches!(
            resolve(Some(Path::new("/c")), None, &file),
            Err(TlsError::Incomplete)
        ));
        assert!(
            resolve(None, None, &TlsFileConfig::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn files_without_a_sandbox_name_the_fix() {
        let r = unrouted_files(&"/files?path=a&signature=v1_x".parse().unwrap()).unwrap();
        assert_eq!(r.status(), http::StatusCode::BAD_REQUEST);
        assert!(UNROUTED_FILES.contains("E2B_SANDBOX_URL"));
        assert!(UNROUTED_FILES.contains("E2B_DOMAIN"));
        assert!(unrouted_files(&"/v1/sandboxes".parse().unwrap()).is_none());
    }
}
