//! The per-user lease (the seed's `sb_container` model): `acquire(user)` returns the
//! user's one warm sandbox, creating it or resuming it as needed.
//!
//! The lease row is the only coordination: every write is a compare-and-set on its
//! `lock_version`, so concurrent acquirers (in one daemon or in several sharing a store)
//! agree without locks. The winner of the insert (or of the move to `creating`) creates
//! the sandbox; everyone else re-reads every ~100 ms until the row says `ready`. A row
//! left in `creating` longer than the stale timeout (a creator that crashed) is taken
//! over by the next acquirer, which logs one warning.

use crate::error::CoreError;
use crate::manager::{Manager, now_ms};
use sandpit_api::CreateSandboxRequest;
use sandpit_store::{LeaseRecord, LeaseStatus, SandboxRecord, SandboxState};
use std::sync::Arc;
use std::time::Duration;

/// Metadata label every lease sandbox carries (its user).
pub const LEASE_LABEL: &str = "sandpit-lease";
/// Longest user name accepted.
pub const MAX_USER_LEN: usize = 128;

/// Timing of the lease protocol.
#[derive(Debug, Clone, Copy)]
pub struct LeaseConfig {
    /// A `creating` row older than this is taken over (its creator is presumed dead).
    pub stale_after: Duration,
    /// Longest an acquire or release waits for others before giving up (503).
    pub max_wait: Duration,
    /// Pause between re-reads while someone else holds the row.
    pub retry: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            stale_after: Duration::from_secs(25),
            max_wait: Duration::from_secs(60),
            retry: Duration::from_millis(100),
        }
    }
}

/// The lease service; shared by the API handlers.
#[derive(Debug, Default)]
pub struct Leases {
    pub cfg: LeaseConfig,
}

/// What an acquire hands back.
#[derive(Debug, Clone)]
pub struct Acquired {
    pub lease: LeaseRecord,
    pub sandbox: SandboxRecord,
    /// This acquirer created the sandbox.
    pub created: bool,
    /// This acquirer resumed it.
    pub resumed: bool,
}

/// Checks a caller-chosen user name (it appears in URLs and labels, never in host paths).
pub fn check_user(user: &str) -> Result<(), CoreError> {
    let ok = !user.is_empty()
        && user.len() <= MAX_USER_LEN
        && user != "."
        && user != ".."
        && user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@+-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(format!(
            "user must be 1 to {MAX_USER_LEN} characters of [A-Za-z0-9._@+-], and not '.' or '..'"
        )))
    }
}

/// Where the lease's current sandbox stands.
enum Found {
    /// Running and its agent alive.
    Running(SandboxRecord),
    /// Paused (or hibernated): resume it.
    Paused(SandboxRecord),
    /// In a transition somebody else drives: look again shortly.
    Busy,
    /// Missing, stopped, failed or dead: replace it.
    Gone,
}

/// Either the outcome, or "the row changed under us: read it again".
enum Step {
    Done(Box<Acquired>),
    Again { wait: bool },
}

impl Leases {
    /// Leases with the given timing.
    pub fn new(cfg: LeaseConfig) -> Self {
        Self { cfg }
    }

    /// Returns `user`'s sandbox, running: the existing one (resumed if paused), or a new
    /// one created with `req` when there is none or it died.
    pub async fn acquire(
        &self,
        m: &Arc<Manager>,
        owner: &str,
        user: &str,
        req: CreateSandboxRequest,
    ) -> Result<Acquired, CoreError> {
        check_user(user)?;
        let deadline = tokio::time::Instant::now() + self.cfg.max_wait;
        let runtime = req
            .runtime
            .clone()
            .unwrap_or_else(|| m.cfg.default_runtime.clone());
        loop {
            if tokio::time::Instant::now() > deadline {
                return Err(CoreError::Unavailable(format!(
                    "gave up after {} s waiting for the lease of user {user:?}: another acquirer holds it",
                    self.cfg.max_wait.as_secs()
                )));
            }
            let step = match m.store.get_lease(owner, user).await? {
                None => self.first(m, owner, user, &runtime, &req).await?,
                Some(cur) if cur.status == LeaseStatus::Ready => {
                    self.ready(m, owner, user, cur, &req).await?
                }
                Some(cur) => self.creating(m, owner, user, cur, &req).await?,
            };
            match step {
                Step::Done(a) => {
                    let what = if a.created { "create" } else { "acquire" };
                    m.usage
                        .log(owner, &a.sandbox.id, crate::usage::LEASE, 1, what);
                    return Ok(*a);
                }
                Step::Again { wait: false } => {}
                Step::Again { wait: true } => tokio::time::sleep(self.jitter()).await,
            }
        }
    }

    /// Re-read pause: about `retry`, spread so that waiters do not move in lockstep.
    fn jitter(&self) -> Duration {
        use rand::Rng;
        let base = self.cfg.retry.as_millis() as u64;
        let spread = base / 5;
        Duration::from_millis(base - spread + rand::rng().random_range(0..=2 * spread))
    }

    /// No lease yet: the first insert wins the right to create.
    async fn first(
        &self,
        m: &Arc<Manager>,
        owner: &str,
        user: &str,
        runtime: &str,
        req: &CreateSandboxRequest,
    ) -> Result<Step, CoreError> {
        let now = now_ms();
        let fresh = LeaseRecord {
            owner: owner.to_string(),
            user: user.to_string(),
            sandbox_id: None,
            status: LeaseStatus::Creating,
            paused: false,
            runtime: runtime.to_string(),
            lock_version: 1,
            usage_ms: 0,
            last_activity_ms: now,
            creating_since_ms: Some(now),
            created_at_ms: now,
            updated_at_ms: now,
        };
        if !m.store.insert_lease(&fresh).await? {
            // Somebody inserted first: read what they wrote.
            return Ok(Step::Again { wait: false });
        }
        self.create(m, fresh, req).await
    }

    /// A settled lease: use its sandbox, or claim the creation of a new one.
    async fn ready(
        &self,
        m: &Arc<Manager>,
        owner: &str,
        user: &str,
        cur: LeaseRecord,
        req: &CreateSandboxRequest,
    ) -> Result<Step, CoreError> {
        let mut retired_ms = 0;
        if let Some(id) = &cur.sandbox_id {
            match self.find(m, owner, id).await? {
                Found::Running(sb) => return self.touch(m, cur, sb, false).await,
                Found::Paused(sb) => {
                    // Thaws a paused sandbox or wakes a hibernated one; one that another
                    // acquirer resumed meanwhile comes back as it is.
                    let sb = m.resume(&sb).await?;
                    return self.touch(m, cur, sb, true).await;
                }
                Found::Busy => return Ok(Step::Again { wait: true }),
                Found::Gone => retired_ms = active_ms_of(m, id).await,
            }
            tracing::info!(owner, user, sandbox_id = %id, "the lease's sandbox is gone; creating another");
        }
        let now = now_ms();
        let next = LeaseRecord {
            status: LeaseStatus::Creating,
            sandbox_id: None,
            creating_since_ms: Some(now),
            usage_ms: cur.usage_ms.saturating_add(retired_ms),
            runtime: req
                .runtime
                .clone()
                .unwrap_or_else(|| m.cfg.default_runtime.clone()),
            paused: false,
            ..cur.clone()
        };
        match m.store.cas_lease(cur.lock_version, &next).await? {
            Some(won) => self.create(m, won, req).await,
            None => Ok(Step::Again { wait: true }),
        }
    }

    /// Somebody is creating: wait, unless they have been at it for too long.
    async fn creating(
        &self,
        m: &Arc<Manager>,
        owner: &str,
        user: &str,
        cur: LeaseRecord,
        req: &CreateSandboxRequest,
    ) -> Result<Step, CoreError> {
        let now = now_ms();
        let since = cur.creating_since_ms.unwrap_or(cur.updated_at_ms);
        let stale_ms = i64::try_from(self.cfg.stale_after.as_millis()).unwrap_or(i64::MAX);
        if now.saturating_sub(since) <= stale_ms {
            return Ok(Step::Again { wait: true });
        }
        let next = LeaseRecord {
            creating_since_ms: Some(now),
            ..cur.clone()
        };
        match m.store.cas_lease(cur.lock_version, &next).await? {
            Some(won) => {
                // Only the CAS winner gets here, so the takeover is logged exactly once.
                tracing::warn!(
                    owner,
                    user,
                    stale_for_ms = now - since,
                    lock_version = won.lock_version,
                    "lease left in `creating` past the stale timeout; taking it over"
                );
                self.create(m, won, req).await
            }
            None => Ok(Step::Again { wait: true }),
        }
    }

    /// We hold the lease in `creating` (at `held.lock_version`): create the sandbox and
    /// publish it. If the lease changed meanwhile (taken over, released), the sandbox is
    /// nobody's and is destroyed.
    async fn create(
        &self,
        m: &Arc<Manager>,
        held: LeaseRecord,
        req: &CreateSandboxRequest,
    ) -> Result<Step, CoreError> {
        let mut req = req.clone();
        req.metadata
            .entry(LEASE_LABEL.to_string())
            .or_insert_with(|| held.user.clone());
        match m.create(&held.owner, req).await {
            Ok(sb) => {
                let next = LeaseRecord {
                    status: LeaseStatus::Ready,
                    sandbox_id: Some(sb.id.clone()),
                    runtime: sb.runtime.clone(),
                    paused: false,
                    creating_since_ms: None,
                    last_activity_ms: now_ms(),
                    ..held.clone()
                };
                match m.store.cas_lease(held.lock_version, &next).await? {
                    Some(won) => Ok(Step::Done(Box::new(Acquired {
                        lease: won,
                        sandbox: sb,
                        created: true,
                        resumed: false,
                    }))),
                    None => {
                        tracing::info!(owner = %held.owner, user = %held.user, sandbox_id = %sb.id,
                            "the lease changed while its sandbox was created; discarding the sandbox");
                        if let Err(e) = m.destroy(&sb).await {
                            tracing::warn!(sandbox_id = %sb.id, error = %e.chain(), "discarding a lease sandbox failed");
                        }
                        Ok(Step::Again { wait: false })
                    }
                }
            }
            Err(e) => {
                // Hand the lease back at once, so that waiters try for themselves instead
                // of sitting out the stale timeout.
                let next = LeaseRecord {
                    status: LeaseStatus::Ready,
                    sandbox_id: None,
                    creating_since_ms: None,
                    ..held.clone()
                };
                if let Err(w) = m.store.cas_lease(held.lock_version, &next).await {
                    tracing::warn!(error = %w, "releasing a lease after a failed create failed");
                }
                Err(e)
            }
        }
    }

    /// Records the acquire on the lease (activity time, not paused). Losing this CAS is
    /// fine if the winner left the same sandbox in place.
    async fn touch(
        &self,
        m: &Arc<Manager>,
        cur: LeaseRecord,
        sb: SandboxRecord,
        resumed: bool,
    ) -> Result<Step, CoreError> {
        let now = now_ms();
        // An acquire is activity: the idle timer starts again.
        m.touch(&sb.id);
        // Twenty acquirers at once need not write twenty times: activity a moment old is
        // fresh enough.
        if !resumed && !cur.paused && now - cur.last_activity_ms < 1000 {
            return Ok(done(cur, sb, resumed));
        }
        let next = LeaseRecord {
            last_activity_ms: now,
            paused: false,
            runtime: sb.runtime.clone(),
            ..cur.clone()
        };
        if let Some(won) = m.store.cas_lease(cur.lock_version, &next).await? {
            return Ok(done(won, sb, resumed));
        }
        match m.store.get_lease(&cur.owner, &cur.user).await? {
            Some(again)
                if again.status == LeaseStatus::Ready
                    && again.sandbox_id.as_deref() == Some(sb.id.as_str()) =>
            {
                Ok(done(again, sb, resumed))
            }
            _ => Ok(Step::Again { wait: true }),
        }
    }

    /// The state of the lease's sandbox `id`.
    async fn find(&self, m: &Arc<Manager>, owner: &str, id: &str) -> Result<Found, CoreError> {
        let Some(sb) = m.store.get_sandbox(id).await?.filter(|s| s.owner == owner) else {
            return Ok(Found::Gone);
        };
        Ok(match sb.state {
            s if s.is_final() || s == SandboxState::Stopping => Found::Gone,
            SandboxState::Creating => Found::Busy,
            SandboxState::Running => {
                if alive(m, &sb).await {
                    Found::Running(sb)
                } else {
                    // Dead before the liveness sweep noticed: tear it down now, so its
                    // resources and active time end here.
                    if let Err(e) = m.destroy(&sb).await {
                        tracing::warn!(sandbox_id = %sb.id, error = %e.chain(), "removing a dead lease sandbox failed");
                    }
                    Found::Gone
                }
            }
            // Paused, or any other resumable state (hibernated).
            _ => Found::Paused(sb),
        })
    }

    /// Removes `user`'s lease and, unless `keep`, destroys its sandbox.
    pub async fn release(
        &self,
        m: &Arc<Manager>,
        owner: &str,
        user: &str,
        keep: bool,
    ) -> Result<(), CoreError> {
        check_user(user)?;
        let deadline = tokio::time::Instant::now() + self.cfg.max_wait;
        loop {
            let Some(cur) = m.store.get_lease(owner, user).await? else {
                return Err(lease_not_found(user));
            };
            if m.store.delete_lease(owner, user, cur.lock_version).await? {
                if !keep
                    && let Some(id) = &cur.sandbox_id
                    && let Some(sb) = m.store.get_sandbox(id).await?.filter(|s| s.owner == owner)
                {
                    m.destroy(&sb).await?;
                }
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(CoreError::unavailable(format!(
                    "the lease of user {user:?} kept changing; try again"
                )));
            }
            tokio::time::sleep(self.jitter()).await;
        }
    }
}

fn done(lease: LeaseRecord, sandbox: SandboxRecord, resumed: bool) -> Step {
    Step::Done(Box::new(Acquired {
        lease,
        sandbox,
        created: false,
        resumed,
    }))
}

/// The 404 of a user without a lease.
pub fn lease_not_found(user: &str) -> CoreError {
    CoreError::not_found(format!("no lease for user {user:?}"))
}

/// Whether the sandbox's agent may still be the process the runtime started: only
/// evidence of its death (not a host too busy to tell) gets a lease a new sandbox.
async fn alive(m: &Manager, sb: &SandboxRecord) -> bool {
    let Ok((rt, h)) = m.runtime_of(sb) else {
        return false;
    };
    tokio::task::spawn_blocking(move || !rt.liveness(&h).is_dead())
        .await
        .unwrap_or(true)
}

/// Active milliseconds of a sandbox (0 when nothing was metered).
pub async fn active_ms_of(m: &Manager, id: &str) -> i64 {
    match m.store.sandbox_usage(id).await {
        Ok(Some(u)) => {
            let end = u.ended_at_ms.unwrap_or_else(now_ms);
            sandpit_store::active_ms(&u.states, 0, end)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_are_checked() {
        for good in [
            "alice",
            "a",
            "alice@example.com",
            "u-1_2.3+x",
            &"x".repeat(128),
        ] {
            assert!(check_user(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../etc",
            "a b",
            "a\0b",
            "ü",
            "a%2Fb",
            "a\nb",
            &"x".repeat(129),
        ] {
            let e = check_user(bad).unwrap_err();
            assert!(matches!(e, CoreError::Invalid(_)), "{bad:?}");
        }
    }

    #[test]
    fn jitter_stays_near_the_retry_pause() {
        let l = Leases::default();
        for _ in 0..100 {
            let j = l.jitter();
            assert!(
                j >= Duration::from_millis(80) && j <= Duration::from_millis(120),
                "{j:?}"
            );
        }
    }
}
