//! Code contexts: a language, a working directory, a user and (while it runs) a worker.
//! Explicit ones come from `POST /code/contexts`; each (language, user) also gets a
//! default context on first use by an `execute` that names none.

use super::InterpError;
use super::protocol::Language;
use super::worker::{Killer, Worker, WorkerSpec};
use crate::config::AgentConfig;
use crate::users::User;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most contexts (and so worker processes) one sandbox may have at once.
pub const MAX_CONTEXTS: usize = 16;

/// A context as the SDK reads it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ContextInfo {
    pub id: String,
    pub language: &'static str,
    pub cwd: String,
}

/// What a cell needs under the context's lock.
pub struct State {
    pub worker: Option<Worker>,
    /// Cells run since the worker started (the SDK's `execution_count`).
    pub count: u64,
}

/// One code context.
pub struct Context {
    pub id: String,
    pub language: Language,
    pub cwd: String,
    pub user: User,
    /// Held for the whole of a cell: cells of one context run one at a time, in order.
    pub state: Arc<tokio::sync::Mutex<State>>,
    /// Kills the current worker without waiting for a running cell to finish.
    killer: Mutex<Option<Killer>>,
    /// Set on delete: a cell that queued before must not start a new worker.
    removed: AtomicBool,
    cfg: Arc<AgentConfig>,
}

impl Context {
    /// The context as JSON.
    pub fn info(&self) -> ContextInfo {
        ContextInfo {
            id: self.id.clone(),
            language: self.language.name(),
            cwd: self.cwd.clone(),
        }
    }

    /// Makes sure a live worker is in `state`, starting one (with fresh state) if needed.
    pub async fn ensure_worker(&self, state: &mut State) -> Result<(), InterpError> {
        if self.removed.load(Ordering::SeqCst) {
            return Err(InterpError::NotFound(format!(
                "context {:?} was deleted",
                self.id
            )));
        }
        if state.worker.as_ref().is_some_and(Worker::alive) {
            return Ok(());
        }
        // A dead worker's leftovers go first.
        state.worker = None;
        state.count = 0;
        let spec = WorkerSpec {
            language: self.language,
            user: self.user.clone(),
            cwd: self.cwd.clone(),
            cfg: self.cfg.clone(),
        };
        let worker = Worker::spawn(&spec).await?;
        *self.killer.lock() = Some(worker.killer());
        state.worker = Some(worker);
        Ok(())
    }

    /// Kills the worker now; a running cell ends with an error and releases the lock.
    pub fn kill_worker(&self) {
        let killer = self.killer.lock().clone();
        if let Some(k) = killer {
            k.kill();
        }
    }
}

#[derive(Default)]
struct Registry {
    by_id: HashMap<String, Arc<Context>>,
    /// Default context id per (language, user name).
    defaults: HashMap<(Language, &'static str), String>,
}

/// All contexts of this sandbox.
pub struct Contexts {
    cfg: Arc<AgentConfig>,
    registry: Mutex<Registry>,
    /// Serializes creation, so two first cells at once share one default context.
    create: tokio::sync::Mutex<()>,
}

/// Checks a context's working directory: absolute, without `..` or NUL.
pub fn validate_cwd(cwd: &str) -> Result<(), InterpError> {
    if !cwd.starts_with('/')
        || cwd.contains('\0')
        || cwd.len() > 4096
        || cwd.split('/').any(|c| c == "..")
    {
        return Err(InterpError::BadRequest(format!(
            "cwd must be an absolute path without '..', not {cwd:?}"
        )));
    }
    Ok(())
}

impl Contexts {
    /// No contexts yet.
    pub fn new(cfg: Arc<AgentConfig>) -> Self {
        Self {
            cfg,
            registry: Mutex::default(),
            create: tokio::sync::Mutex::new(()),
        }
    }

    /// The sandbox's default working directory.
    pub fn default_cwd(&self) -> String {
        self.cfg.workdir()
    }

    /// Creates a context and starts its worker; nothing is left behind on failure.
    pub async fn create(
        &self,
        language: Language,
        cwd: String,
        user: User,
    ) -> Result<Arc<Context>, InterpError> {
        let _serial = self.create.lock().await;
        self.create_locked(language, cwd, user, false).await
    }

    async fn create_locked(
        &self,
        language: Language,
        cwd: String,
        user: User,
        default: bool,
    ) -> Result<Arc<Context>, InterpError> {
        validate_cwd(&cwd)?;
        if self.registry.lock().by_id.len() >= MAX_CONTEXTS {
            return Err(InterpError::Conflict(format!(
                "this sandbox already has {MAX_CONTEXTS} code contexts; delete one first"
            )));
        }
        let ctx = Arc::new(Context {
            id: uuid::Uuid::new_v4().to_string(),
            language,
            cwd,
            user,
            state: Arc::new(tokio::sync::Mutex::new(State {
                worker: None,
                count: 0,
            })),
            killer: Mutex::new(None),
            removed: AtomicBool::new(false),
            cfg: self.cfg.clone(),
        });
        {
            let mut state = ctx.state.lock().await;
            ctx.ensure_worker(&mut state).await?;
        }
        let mut reg = self.registry.lock();
        reg.by_id.insert(ctx.id.clone(), ctx.clone());
        if default {
            reg.defaults
                .insert((language, ctx.user.name), ctx.id.clone());
        }
        Ok(ctx)
    }

    /// The default context of `language` for `user`, created on first use.
    pub async fn default_for(
        &self,
        language: Language,
        user: User,
    ) -> Result<Arc<Context>, InterpError> {
        if let Some(ctx) = self.find_default(language, user.name) {
            return Ok(ctx);
        }
        let _serial = self.create.lock().await;
        if let Some(ctx) = self.find_default(language, user.name) {
            return Ok(ctx);
        }
        let cwd = self.default_cwd();
        self.create_locked(language, cwd, user, true).await
    }

    fn find_default(&self, language: Language, user: &'static str) -> Option<Arc<Context>> {
        let reg = self.registry.lock();
        reg.defaults
            .get(&(language, user))
            .and_then(|id| reg.by_id.get(id))
            .cloned()
    }

    /// A context by id.
    pub fn get(&self, id: &str) -> Result<Arc<Context>, InterpError> {
        self.registry
            .lock()
            .by_id
            .get(id)
            .cloned()
            .ok_or_else(|| InterpError::NotFound(format!("context {id:?} not found")))
    }

    /// Every context, oldest first is not promised; sorted by id for a stable answer.
    pub fn list(&self) -> Vec<ContextInfo> {
        let mut all: Vec<ContextInfo> = self
            .registry
            .lock()
            .by_id
            .values()
            .map(|c| c.info())
            .collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// Removes a context and kills its worker.
    pub fn remove(&self, id: &str) -> Result<(), InterpError> {
        let ctx = {
            let mut reg = self.registry.lock();
            let ctx = reg
                .by_id
                .remove(id)
                .ok_or_else(|| InterpError::NotFound(format!("context {id:?} not found")))?;
            reg.defaults.retain(|_, v| v != id);
            ctx
        };
        ctx.removed.store(true, Ordering::SeqCst);
        ctx.kill_worker();
        Ok(())
    }

    /// Kills the context's worker and starts a fresh one (its variables are gone).
    pub async fn restart(&self, id: &str) -> Result<(), InterpError> {
        let ctx = self.get(id)?;
        ctx.kill_worker();
        let mut state = ctx.state.lock().await;
        state.worker = None;
        ctx.ensure_worker(&mut state).await
    }
}
