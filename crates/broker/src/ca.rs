//! Per-sandbox certificate authorities. Each sandbox trusts a CA of its own whose key is
//! derived from the broker's master key and the sandbox's id: it never leaves the daemon,
//! is never stored, and signs only the leaf certificates the broker shows that sandbox for
//! the hosts it intercepts.

use super::BrokerError;
use super::crypto::Keys;
use parking_lot::Mutex;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a leaf certificate is valid, and how long the broker reuses it (less, so
/// that a reused one is never close to its end).
const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);
const LEAF_REUSE: Duration = Duration::from_secs(24 * 3600);
/// Leaf TLS configurations kept; the cache is emptied when it would grow beyond.
const LEAF_CACHE_MAX: usize = 4096;

/// The rustls provider every TLS configuration of the broker uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// TLS configurations minted per (sandbox, host), with when they were made.
type LeafCache = HashMap<(String, String), (Arc<rustls::ServerConfig>, Instant)>;

/// Mints sandbox CAs and the leaf certificates they sign.
pub struct Authority {
    keys: Arc<Keys>,
    leaves: Mutex<LeafCache>,
}

fn ca_params(sandbox_id: &str) -> CertificateParams {
    use sha2::Digest;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "sandpit credential broker");
    dn.push(
        DnType::CommonName,
        format!("sandpit sandbox {sandbox_id} CA"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    // Fixed dates and serial: the same CA certificate at every boot of the sandbox.
    params.not_before = rcgen::date_time_ymd(2025, 1, 1);
    params.not_after = rcgen::date_time_ymd(2125, 1, 1);
    let digest = sha2::Sha256::digest(sandbox_id.as_bytes());
    let mut serial = digest[..16].to_vec();
    serial[0] &= 0x7f;
    params.serial_number = Some(SerialNumber::from_slice(&serial));
    params
}

impl Authority {
    /// An authority over CAs derived from `keys`.
    pub fn new(keys: Arc<Keys>) -> Self {
        Self {
            keys,
            leaves: Mutex::default(),
        }
    }

    fn ca_key(&self, sandbox_id: &str) -> Result<KeyPair, BrokerError> {
        let der = self.keys.sandbox_ca_key(sandbox_id)?;
        KeyPair::from_pkcs8_der_and_sign_algo(
            &PrivatePkcs8KeyDer::from(der.as_slice()),
            &PKCS_ECDSA_P256_SHA256,
        )
        .map_err(|source| BrokerError::Cert {
            what: "CA key".into(),
            source,
        })
    }

    /// The CA certificate sandbox `sandbox_id` trusts, PEM.
    pub fn ca_pem(&self, sandbox_id: &str) -> Result<String, BrokerError> {
        let key = self.ca_key(sandbox_id)?;
        let cert = ca_params(sandbox_id)
            .self_signed(&key)
            .map_err(|source| BrokerError::Cert {
                what: "CA certificate".into(),
                source,
            })?;
        Ok(cert.pem())
    }

    /// The TLS server configuration shown to sandbox `sandbox_id` for `host`: a leaf
    /// certificate for that name signed by the sandbox's CA, HTTP/1.1 only.
    pub fn server_config(
        &self,
        sandbox_id: &str,
        host: &str,
    ) -> Result<Arc<rustls::ServerConfig>, BrokerError> {
        let key = (sandbox_id.to_string(), host.to_string());
        let reused = self
            .leaves
            .lock()
            .get(&key)
            .filter(|(_, at)| at.elapsed() < LEAF_REUSE)
            .map(|(cfg, _)| cfg.clone());
        if let Some(cfg) = reused {
            return Ok(cfg);
        }
        let cfg = Arc::new(self.mint(sandbox_id, host)?);
        let mut cache = self.leaves.lock();
        if cache.len() >= LEAF_CACHE_MAX {
            cache.clear();
        }
        cache.insert(key, (cfg.clone(), Instant::now()));
        Ok(cfg)
    }

    /// Forgets the leaf certificates of a sandbox.
    pub fn forget(&self, sandbox_id: &str) {
        self.leaves.lock().retain(|(id, _), _| id != sandbox_id);
    }

    /// A leaf certificate for `host` signed by sandbox `sandbox_id`'s CA, and its key.
    pub fn leaf(
        &self,
        sandbox_id: &str,
        host: &str,
    ) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), BrokerError> {
        let cert_err = |source: rcgen::Error| BrokerError::Cert {
            what: format!("leaf for {host}"),
            source,
        };
        let issuer = Issuer::new(ca_params(sandbox_id), self.ca_key(sandbox_id)?);
        let leaf_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert_err)?;
        let mut params = CertificateParams::new(vec![host.to_string()]).map_err(cert_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + LEAF_VALIDITY;
        let cert = params.signed_by(&leaf_key, &issuer).map_err(cert_err)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        Ok((cert.der().clone(), key))
    }

    fn mint(&self, sandbox_id: &str, host: &str) -> Result<rustls::ServerConfig, BrokerError> {
        let (cert, key) = self.leaf(sandbox_id, host)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| BrokerError::Tls {
                what: "certificate: TLS versions".into(),
                source,
            })?
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .map_err(|source| BrokerError::Tls {
                what: format!("certificate: leaf for {host}"),
                source,
            })?;
        // Only HTTP/1.1 is parsed here; a client offering h2 as well picks HTTP/1.1.
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{ServerName, UnixTime};

    fn verifier(ca_pem: &str) -> Arc<rustls::client::WebPkiServerVerifier> {
        let mut roots = rustls::RootCertStore::empty();
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM parses");
        roots.add(ca).expect("CA certificate is usable");
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .unwrap()
    }

    #[test]
    fn the_ca_is_stable_and_signs_leaves_a_client_accepts() {
        let auth = Authority::new(Arc::new(Keys::new(&[9; 32]).unwrap()));
        let pem = auth.ca_pem("sbx1").unwrap();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let (leaf, _) = auth.leaf("sbx1", "api.example.com").unwrap();
        let name = ServerName::try_from("api.example.com").unwrap();
        let other = ServerName::try_from("evil.example.com").unwrap();
        let now = UnixTime::now();
        // The CA as written at one boot still vouches for leaves minted later (same key,
        // same name), and a CA minted again verifies the same leaf.
        for ca in [pem, auth.ca_pem("sbx1").unwrap()] {
            let v = verifier(&ca);
            assert!(v.verify_server_cert(&leaf, &[], &name, &[], now).is_ok());
            assert!(v.verify_server_cert(&leaf, &[], &other, &[], now).is_err());
        }
        // Another sandbox's CA does not vouch for this sandbox's leaves.
        let v2 = verifier(&auth.ca_pem("sbx2").unwrap());
        assert!(v2.verify_server_cert(&leaf, &[], &name, &[], now).is_err());
        let cfg = auth.server_config("sbx1", "api.example.com").unwrap();
        let cached = auth.server_config("sbx1", "api.example.com").unwrap();
        assert!(Arc::ptr_eq(&cfg, &cached));
        auth.forget("sbx1");
        let fresh = auth.server_config("sbx1", "api.example.com").unwrap();
        assert!(!Arc::ptr_eq(&cfg, &fresh));
    }

    #[test]
    fn certificate_errors_keep_the_cause() {
        use std::error::Error as _;
        let e = BrokerError::Cert {
            what: "leaf for api.test".into(),
            source: rcgen::Error::CouldNotParseCertificate,
        };
        assert!(
            e.to_string()
                .starts_with("certificate: leaf for api.test: "),
            "{e}"
        );
        assert!(e.source().is_some_and(|s| s.is::<rcgen::Error>()));
        let tls = BrokerError::Tls {
            what: "certificate: leaf for api.test".into(),
            source: rustls::Error::General("no".into()),
        };
        assert!(
            tls.to_string()
                .starts_with("certificate: leaf for api.test: "),
            "{tls}"
        );
        assert!(tls.source().is_some_and(|s| s.is::<rustls::Error>()));
    }
}
