//! TLS for the server: a test CA with a leaf certificate it generates, or PEM files given.

use crate::ModelSimError;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A certificate chain and its key, PEM, that the server presents.
#[derive(Clone)]
pub struct TlsIdentity {
    /// The leaf first, then any intermediates.
    pub cert_chain_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity").finish_non_exhaustive()
    }
}

/// A throw-away CA and one leaf certificate it signed for the names a test listens on.
#[derive(Clone)]
pub struct TestCa {
    /// The CA certificate a client trusts (`NODE_EXTRA_CA_CERTS`, `SSL_CERT_FILE`).
    pub ca_pem: String,
    /// The leaf the server presents.
    pub identity: TlsIdentity,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// Where [`TestCa::write_to`] put the files.
#[derive(Debug, Clone)]
pub struct TestCaFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA and a leaf for `names`: DNS names, or IP addresses (which become IP SANs).
    pub fn generate(names: &[String]) -> Result<Self, ModelSimError> {
        let now = time::OffsetDateTime::now_utc();
        let mut ca = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "sandpit-modelsim test CA");
        ca.distinguished_name = dn;
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        // Backdated a little: a namespace's clock is the host's, but a test may run on a
        // machine whose clock was just adjusted.
        ca.not_before = now - time::Duration::hours(1);
        ca.not_after = now + time::Duration::days(30);
        let ca_key = KeyPair::generate().map_err(ModelSimError::Cert)?;
        let ca_cert = ca.self_signed(&ca_key).map_err(ModelSimError::Cert)?;
        let ca_pem = ca_cert.pem();
        let issuer = Issuer::new(ca, ca_key);

        let mut leaf = CertificateParams::new(names.to_vec()).map_err(ModelSimError::Cert)?;
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            names.first().map_or("modelsim", String::as_str),
        );
        leaf.distinguished_name = dn;
        leaf.is_ca = IsCa::ExplicitNoCa;
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        leaf.not_before = now - time::Duration::hours(1);
        leaf.not_after = now + time::Duration::days(30);
        let leaf_key = KeyPair::generate().map_err(ModelSimError::Cert)?;
        let leaf_cert = leaf
            .signed_by(&leaf_key, &issuer)
            .map_err(ModelSimError::Cert)?;
        Ok(TestCa {
            ca_pem,
            identity: TlsIdentity {
                cert_chain_pem: leaf_cert.pem(),
                key_pem: leaf_key.serialize_pem(),
            },
        })
    }

    /// Writes `ca.pem`, `cert.pem` and `key.pem` (mode 0600) into `dir`.
    pub fn write_to(&self, dir: &Path) -> Result<TestCaFiles, ModelSimError> {
        let files = TestCaFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        let write = |path: &Path, text: &str, mode: u32| {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|source| ModelSimError::WritePem {
                    path: path.to_path_buf(),
                    source,
                })
        };
        write(&files.ca, &self.ca_pem, 0o644)?;
        write(&files.cert, &self.identity.cert_chain_pem, 0o644)?;
        write(&files.key, &self.identity.key_pem, 0o600)?;
        Ok(files)
    }
}

impl TlsIdentity {
    /// Reads a certificate chain and a key from PEM files.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, ModelSimError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| ModelSimError::ReadPem {
                path: path.to_path_buf(),
                source,
            })
        };
        let identity = TlsIdentity {
            cert_chain_pem: read(cert)?,
            key_pem: read(key)?,
        };
        // Checked now, so a bad file names its path instead of failing at the first client.
        identity.parts(cert, key)?;
        Ok(identity)
    }

    fn parts(
        &self,
        cert_path: &Path,
        key_path: &Path,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ModelSimError> {
        let chain = CertificateDer::pem_slice_iter(self.cert_chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .and_then(|c| {
                if c.is_empty() {
                    Err(rustls_pki_types::pem::Error::NoItemsFound)
                } else {
                    Ok(c)
                }
            })
            .map_err(|source| ModelSimError::Pem {
                path: cert_path.to_path_buf(),
                what: "certificate",
                source,
            })?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|source| {
            ModelSimError::Pem {
                path: key_path.to_path_buf(),
                what: "private key",
                source,
            }
        })?;
        Ok((chain, key))
    }

    /// The rustls configuration: HTTP/1.1 only, which every harness's client speaks.
    pub(crate) fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, ModelSimError> {
        let (chain, key) = self.parts(Path::new("<certificate>"), Path::new("<key>"))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(ModelSimError::Tls)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(ModelSimError::Tls)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}
