//! Per-user leases and the seed's `withSandbox` wrapper.
//!
//! ```no_run
//! # async fn demo(client: sandpit_client::Client) -> Result<(), sandpit_client::ClientError> {
//! use sandpit_client::SandboxLease;
//! use sandpit_api::{CreateSandboxRequest, RunCommandRequest};
//!
//! let lease = SandboxLease::new(client, "alice", CreateSandboxRequest::default());
//! let out = lease
//!     .with_sandbox(|c, id| async move {
//!         let req = RunCommandRequest { argv: vec!["pip".into(), "--version".into()], ..Default::default() };
//!         c.run(&id, &req).await
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

use std::future::Future;

use reqwest::Method;
use sandpit_api::CreateSandboxRequest;
use sandpit_api::leases::{Acquired, Lease, LeaseList};

use crate::{Client, ClientError};

/// Error code the daemon gives a request naming a sandbox that does not exist.
pub const SANDBOX_NOT_FOUND: &str = "sandbox_not_found";
/// Error code the daemon gives a request needing a sandbox that has stopped for good.
pub const SANDBOX_STOPPED: &str = "sandbox_stopped";

impl ClientError {
    /// True if the call failed because its sandbox no longer exists: HTTP 404 with code
    /// `sandbox_not_found`, or HTTP 409 with code `sandbox_stopped` (it died or failed).
    /// A missing file (404 `not_found`), a paused sandbox, a failed command or a network
    /// error is not this.
    pub fn is_sandbox_gone(&self) -> bool {
        matches!(
            self,
            ClientError::Api { status: 404, code, .. } if code == SANDBOX_NOT_FOUND
        ) || matches!(
            self,
            ClientError::Api { status: 409, code, .. } if code == SANDBOX_STOPPED
        )
    }
}

impl Client {
    /// `POST /v1/leases/{user}/acquire`: the user's one warm sandbox, running. It is
    /// created (from `opts`) on first use or after it died, and resumed if paused.
    pub async fn acquire(
        &self,
        user: &str,
        opts: &CreateSandboxRequest,
    ) -> Result<Acquired, ClientError> {
        self.json(
            self.req(Method::POST, &["leases", user, "acquire"])?
                .json(opts),
        )
        .await
    }

    /// `GET /v1/leases`: the caller's leases.
    pub async fn list_leases(&self) -> Result<Vec<Lease>, ClientError> {
        let list: LeaseList = self.json(self.req(Method::GET, &["leases"])?).await?;
        Ok(list.items)
    }

    /// `GET /v1/leases/{user}`.
    pub async fn get_lease(&self, user: &str) -> Result<Lease, ClientError> {
        self.json(self.req(Method::GET, &["leases", user])?).await
    }

    /// `DELETE /v1/leases/{user}`: ends the lease and destroys its sandbox, unless `keep`.
    pub async fn release(&self, user: &str, keep: bool) -> Result<(), ClientError> {
        let rb = self.req(Method::DELETE, &["leases", user])?;
        let rb = if keep {
            rb.query(&[("keep", "true")])
        } else {
            rb
        };
        self.send(rb).await.map(drop)
    }
}

/// A user's lease as seen by one program: the sandbox id is cached between calls, and
/// [`SandboxLease::with_sandbox`] recreates a sandbox that vanished, once.
#[derive(Debug)]
pub struct SandboxLease {
    client: Client,
    user: String,
    opts: CreateSandboxRequest,
    cached: tokio::sync::Mutex<Option<String>>,
}

impl SandboxLease {
    /// A lease of `user`'s sandbox; `opts` are used whenever a sandbox has to be created.
    pub fn new(client: Client, user: &str, opts: CreateSandboxRequest) -> Self {
        Self {
            client,
            user: user.to_string(),
            opts,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The cached sandbox id, acquiring the lease first if there is none.
    pub async fn sandbox_id(&self) -> Result<String, ClientError> {
        let mut cached = self.cached.lock().await;
        if let Some(id) = cached.as_ref() {
            return Ok(id.clone());
        }
        let got = self.client.acquire(&self.user, &self.opts).await?;
        *cached = Some(got.sandbox.id.clone());
        Ok(got.sandbox.id)
    }

    /// Forgets the cached sandbox id; the next call acquires again.
    pub async fn clear(&self) {
        *self.cached.lock().await = None;
    }

    /// Runs `call` with the client and the user's sandbox id. If it fails because the
    /// sandbox no longer exists ([`ClientError::is_sandbox_gone`]), the cached id is
    /// cleared, the lease is acquired again (the daemon replaces the dead sandbox) and
    /// `call` runs once more; that second result is returned whatever it is. Any other
    /// error is returned at once, unchanged.
    pub async fn with_sandbox<T, F, Fut>(&self, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(Client, String) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let id = self.sandbox_id().await?;
        match call(self.client.clone(), id.clone()).await {
            Err(e) if e.is_sandbox_gone() => {
                {
                    let mut cached = self.cached.lock().await;
                    // Another task may have replaced it already; only forget the dead one.
                    if cached.as_deref() == Some(id.as_str()) {
                        *cached = None;
                    }
                }
                let id = self.sandbox_id().await?;
                call(self.client.clone(), id).await
            }
            other => other,
        }
    }
}
