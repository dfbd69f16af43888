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
    #[error("{0}")]
    Internal(String),
}

impl InterpError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            InterpError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_argument"),
            InterpError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            InterpError::Conflict(_) => (StatusCode::CONFLICT, "failed_precondition"),
            InterpError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
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
