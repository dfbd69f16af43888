//! The code interpreter: an E2B code-interpreter compatible server inside the agent. The
//! daemon maps sandbox port 49999 onto these routes, with the request path under `/code`:
//! `POST /code/execute` streams a cell's output as NDJSON; `/code/contexts` creates, lists,
//! deletes and restarts contexts; `GET /code/health`. Cells run in worker processes (one
//! per context: python3, node or bash) that keep their state between cells.

mod contexts;
mod exec;
pub mod protocol;
mod routes;
mod worker;

pub use contexts::MAX_CONTEXTS;
pub use routes::router;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Why a code-interpreter request failed; each maps onto an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum InterpError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    /// Something that should not fail did, with no underlying error to keep.
    #[error("{0}")]
    Internal(String),
    /// The request's body is not the JSON it should be.
    #[error("invalid request body: {0}")]
    Body(#[source] serde_json::Error),
    /// The request names a language the interpreter does not run.
    #[error(transparent)]
    Language(#[from] protocol::UnsupportedLanguage),
    /// A system call for a worker failed; `context` names what was being done.
    #[error("{context}: {source}")]
    Sys {
        context: &'static str,
        #[source]
        source: nix::errno::Errno,
    },
    /// An i/o operation with a worker failed; `context` names what was being done.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The streamed response could not be built.
    #[error(transparent)]
    Http(#[from] axum::http::Error),
}

impl InterpError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            InterpError::BadRequest(_) | InterpError::Body(_) | InterpError::Language(_) => {
                (StatusCode::BAD_REQUEST, "invalid_argument")
            }
            InterpError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            InterpError::Conflict(_) => (StatusCode::CONFLICT, "failed_precondition"),
            InterpError::Internal(_)
            | InterpError::Sys { .. }
            | InterpError::Io { .. }
            | InterpError::Http(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for InterpError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            tracing::warn!(error = %self, "code interpreter");
        }
        let body = serde_json::json!({"code": code, "message": self.to_string()});
        (status, axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn an_unsupported_language_is_the_callers_fault_and_reads_as_before() {
        let e = InterpError::from(protocol::Language::parse(Some("cobol")).unwrap_err());
        assert_eq!(
            e.status_and_code(),
            (StatusCode::BAD_REQUEST, "invalid_argument")
        );
        assert_eq!(
            e.to_string(),
            "language \"cobol\" is not supported here (supported: python, javascript, bash)"
        );
    }

    #[test]
    fn a_malformed_body_is_the_callers_fault_and_keeps_the_parse_error() {
        let json = serde_json::from_str::<u8>("[").unwrap_err();
        let shown = json.to_string();
        let e = InterpError::Body(json);
        assert_eq!(e.to_string(), format!("invalid request body: {shown}"));
        assert_eq!(e.status_and_code().0, StatusCode::BAD_REQUEST);
        assert!(e.source().is_some());
    }

    #[test]
    fn worker_failures_keep_their_cause() {
        let e = InterpError::Sys {
            context: "pipe",
            source: nix::errno::Errno::EMFILE,
        };
        assert_eq!(
            e.to_string(),
            format!("pipe: {}", nix::errno::Errno::EMFILE)
        );
        assert_eq!(
            e.source()
                .and_then(|s| s.downcast_ref::<nix::errno::Errno>()),
            Some(&nix::errno::Errno::EMFILE)
        );
        assert_eq!(e.status_and_code().0, StatusCode::INTERNAL_SERVER_ERROR);
        let io = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let shown = io.to_string();
        let e = InterpError::Io {
            context: "writing to the worker".into(),
            source: io,
        };
        assert_eq!(e.to_string(), format!("writing to the worker: {shown}"));
        assert!(e.source().is_some());
    }
}
