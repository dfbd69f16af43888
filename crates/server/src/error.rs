//! API errors: a status and a JSON `{code, message}` body, never a bare 500 for bad input.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use sandpit_api::ErrorBody;

/// An error answered to an API client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "failed_precondition", message)
    }
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    /// An internal failure caused by `e`, its whole chain of causes kept in the message.
    pub fn internal_from(context: &str, e: &(dyn std::error::Error + 'static)) -> Self {
        let mut message = format!("{context}: {e}");
        let mut cur = e.source();
        while let Some(s) = cur {
            message.push_str(": ");
            message.push_str(&s.to_string());
            cur = s.source();
        }
        Self::internal(message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
    /// The sandbox does not exist (or is not the caller's): clients such as the lease
    /// wrapper recognise this code and acquire a fresh sandbox.
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            SANDBOX_NOT_FOUND,
            format!("sandbox {id} not found"),
        )
    }
    /// The sandbox has stopped for good (its agent died, or it failed): like
    /// [`Self::sandbox_not_found`] for clients, but its record can still be read.
    pub fn sandbox_stopped(id: &str, state: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            SANDBOX_STOPPED,
            format!("sandbox {id} is {state}"),
        )
    }
}

/// Error code of a request naming a sandbox that does not exist.
pub const SANDBOX_NOT_FOUND: &str = "sandbox_not_found";
/// Error code of a request needing a sandbox that has stopped for good.
pub const SANDBOX_STOPPED: &str = "sandbox_stopped";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, message = %self.message, "request failed");
        }
        (
            self.status,
            Json(ErrorBody {
                code: self.code.to_string(),
                message: self.message,
            }),
        )
            .into_response()
    }
}

impl From<sandpit_store::StoreError> for ApiError {
    fn from(e: sandpit_store::StoreError) -> Self {
        match e {
            sandpit_store::StoreError::InvalidCursor => ApiError::bad_request("invalid cursor"),
            sandpit_store::StoreError::NotFound(m) => ApiError::not_found(m),
            sandpit_store::StoreError::Conflict(m) => ApiError::conflict(m),
            e @ sandpit_store::StoreError::ActiveRun { .. } => ApiError::conflict(e.to_string()),
            other => ApiError::internal(format!("store: {other}")),
        }
    }
}

impl From<sandpit_broker::BrokerError> for ApiError {
    fn from(e: sandpit_broker::BrokerError) -> Self {
        use sandpit_broker::BrokerError as E;
        let message = e.to_string();
        match e {
            E::Disabled => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "broker_disabled", message)
            }
            E::Invalid(m) => ApiError::bad_request(m),
            E::NotFound(m) => ApiError::not_found(m),
            E::AlreadyExists(m) => ApiError::new(StatusCode::CONFLICT, "already_exists", m),
            E::TooMany(m) => ApiError::new(StatusCode::CONFLICT, "resource_exhausted", m),
            E::Store(e) => e.into(),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<sandpit_net::NetError> for ApiError {
    fn from(e: sandpit_net::NetError) -> Self {
        use sandpit_net::NetError as E;
        match e {
            E::InvalidPolicy(m) => ApiError::bad_request(m),
            e @ E::Policy(_) => ApiError::bad_request(e.to_string()),
            E::SandboxNotFound(id) => ApiError::sandbox_not_found(&id),
            E::Store(e) => e.into(),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<sandpit_runtime::RuntimeError> for ApiError {
    fn from(e: sandpit_runtime::RuntimeError) -> Self {
        use sandpit_runtime::RuntimeError as E;
        match e {
            E::InvalidSpec(m) => ApiError::bad_request(m),
            // The path's own words, as the request's other refusals read.
            E::MountPath(e) => ApiError::bad_request(e.to_string()),
            E::Unsupported(m) => ApiError::new(StatusCode::NOT_IMPLEMENTED, "unimplemented", m),
            E::Tampered(m) => ApiError::conflict(m),
            // Refused, not failed: the host is short of descriptors or memory for now.
            other if other.is_host_exhaustion() => ApiError::unavailable(format!(
                "the host is out of resources, try again later: {other}"
            )),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<connectrpc::ConnectError> for ApiError {
    fn from(e: connectrpc::ConnectError) -> Self {
        use connectrpc::ErrorCode as C;
        let msg = e
            .message
            .clone()
            .unwrap_or_else(|| e.code.as_str().to_string());
        let (status, code) = match e.code {
            C::InvalidArgument | C::OutOfRange => (StatusCode::BAD_REQUEST, "invalid_argument"),
            C::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            C::AlreadyExists => (StatusCode::CONFLICT, "already_exists"),
            C::PermissionDenied => (StatusCode::FORBIDDEN, "permission_denied"),
            C::FailedPrecondition | C::Aborted => (StatusCode::CONFLICT, "failed_precondition"),
            C::ResourceExhausted => (StatusCode::INSUFFICIENT_STORAGE, "resource_exhausted"),
            C::Unimplemented => (StatusCode::NOT_IMPLEMENTED, "unimplemented"),
            C::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded"),
            C::Unavailable => (StatusCode::BAD_GATEWAY, "unavailable"),
            _ => (StatusCode::BAD_GATEWAY, "agent_error"),
        };
        ApiError::new(status, code, msg)
    }
}

impl From<sandpit_core::CoreError> for ApiError {
    /// The one place the core's failures become statuses.
    fn from(e: sandpit_core::CoreError) -> Self {
        use sandpit_core::CoreError as E;
        match e {
            E::Invalid(m) => ApiError::bad_request(m),
            E::NotFound(m) => ApiError::not_found(m),
            E::SandboxNotFound(id) => ApiError::sandbox_not_found(&id),
            E::SandboxStopped { id, state } => ApiError::sandbox_stopped(&id, &state),
            E::Conflict(m) => ApiError::conflict(m),
            E::Forbidden(m) => ApiError::new(StatusCode::FORBIDDEN, "permission_denied", m),
            E::Unprocessable { code, message } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
            }
            E::InsufficientStorage(m) => {
                ApiError::new(StatusCode::INSUFFICIENT_STORAGE, "resource_exhausted", m)
            }
            E::Unavailable(m) => ApiError::unavailable(m),
            E::Agent(e) => e.into(),
            E::Store(e) => e.into(),
            E::Runtime(e) => e.into(),
            E::Net(e) => e.into(),
            E::Broker(e) => e.into(),
            e @ E::Storage(_) => ApiError::unavailable(e.chain()),
            e @ (E::Image(_) | E::Io { .. } | E::Internal { .. }) => {
                tracing::warn!(error = %e.chain(), "internal failure");
                ApiError::internal(e.chain())
            }
        }
    }
}
