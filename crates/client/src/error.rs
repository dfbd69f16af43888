//! The one error type every client call returns.

use sandpit_api::ErrorBody;
use tokio_tungstenite::tungstenite;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon answered with an error status and (usually) a JSON `{code, message}` body.
    #[error("{message} ({code})")]
    Api {
        /// HTTP status code.
        status: u16,
        /// Stable machine-readable code, e.g. `not_found`.
        code: String,
        /// Human-readable message from the daemon.
        message: String,
    },
    /// The HTTP request could not be sent or its response not received.
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    /// A response or stream message was not what the API promises.
    #[error("unexpected response: {0}")]
    Decode(String),
    /// The WebSocket connection failed.
    #[error("websocket: {0}")]
    WebSocket(Box<tungstenite::Error>),
    /// The command stream ended or misbehaved in a way the protocol does not allow.
    #[error("command stream: {0}")]
    Protocol(String),
    /// The daemon reported an error on a command stream (for example, the program could not be started).
    #[error("{0}")]
    Command(String),
    /// The base URL or API key given to [`crate::Client::new`] is unusable.
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// A local file could not be read or written.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ClientError {
    /// HTTP status of an API error, if this is one.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Machine-readable code of an API error, if this is one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// True if the daemon could not be reached at all (connection refused, no route, ...).
    pub fn is_connect(&self) -> bool {
        match self {
            ClientError::Http(e) => e.is_connect(),
            ClientError::WebSocket(e) => matches!(**e, tungstenite::Error::Io(_)),
            _ => false,
        }
    }

    /// True if the daemon said the resource does not exist (HTTP 404).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }
}

impl From<tungstenite::Error> for ClientError {
    fn from(err: tungstenite::Error) -> Self {
        match err {
            // A refused upgrade carries the daemon's normal JSON error body.
            tungstenite::Error::Http(resp) => {
                let status = resp.status().as_u16();
                from_body(status, resp.body().as_deref().unwrap_or_default())
            }
            other => ClientError::WebSocket(Box::new(other)),
        }
    }
}

/// Builds an [`ClientError::Api`] from an error response body, JSON or not.
pub(crate) fn from_body(status: u16, body: &[u8]) -> ClientError {
    if let Ok(b) = serde_json::from_slice::<ErrorBody>(body) {
        return ClientError::Api {
            status,
            code: b.code,
            message: b.message,
        };
    }
    // Not our JSON (a proxy, or a panic page): keep whatever text there is.
    let text = String::from_utf8_lossy(body).trim().to_string();
    let code = default_code(status).to_string();
    let message = if text.is_empty() {
        format!("HTTP status {status}")
    } else {
        text
    };
    ClientError::Api {
        status,
        code,
        message,
    }
}

/// The code the daemon would most likely have used for a bare status.
fn default_code(status: u16) -> &'static str {
    match status {
        400 => "invalid_argument",
        401 => "unauthenticated",
        403 => "permission_denied",
        404 => "not_found",
        409 => "conflict",
        413 => "too_large",
        429 => "resource_exhausted",
        501 => "unimplemented",
        502..=504 => "unavailable",
        500..=599 => "internal",
        _ => "http_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_error_bodies_are_decoded() {
        let e = from_body(404, br#"{"code":"not_found","message":"no sandbox x"}"#);
        match e {
            ClientError::Api {
                status,
                code,
                message,
            } => {
                assert_eq!(
                    (status, code.as_str(), message.as_str()),
                    (404, "not_found", "no sandbox x")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_bodies_keep_their_text() {
        let e = from_body(502, b"Bad Gateway\n");
        assert_eq!(e.code(), Some("unavailable"));
        assert_eq!(e.to_string(), "Bad Gateway (unavailable)");
        let e = from_body(401, b"");
        assert_eq!(e.to_string(), "HTTP status 401 (unauthenticated)");
    }
}
