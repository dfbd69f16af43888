//! The errors of starting a model server.

use std::path::PathBuf;

/// Why a model server could not start or a file it needs could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelSimError {
    /// The script file could not be read.
    #[error("reading the script {path}")]
    ReadScript {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The script file is not a valid script.
    #[error("parsing the script {path}")]
    ParseScript {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The listening address could not be bound.
    #[error("binding {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The request log could not be opened.
    #[error("opening the request log {path}")]
    OpenLog {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A PEM file could not be read.
    #[error("reading {path}")]
    ReadPem {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A PEM file holds no usable certificate or key.
    #[error("{path} holds no {what}")]
    Pem {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The certificate and key do not make a TLS configuration.
    #[error("TLS configuration")]
    Tls(#[source] rustls::Error),
    /// Generating the test CA or a certificate failed.
    #[error("generating a certificate")]
    Cert(#[source] rcgen::Error),
    /// Writing generated certificate files failed.
    #[error("writing {path}")]
    WritePem {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
