//! Creating a sandbox: planning it (runtime, template, limits, network), a claim from a
//! warm pool when one matches, else a cold start: boot through the runtime, wait for the
//! agent, apply the caller's settings, start the template's services.

use crate::error::CoreError;
use crate::manager::*;
use crate::pools::PoolKey;
use crate::sandbox_delete::run_destroy;
use sandpit_api::CreateSandboxRequest;
use sandpit_runtime::{Runtime, SandboxHandle, SandboxSpec};
use sandpit_store::{SandboxRecord, SandboxState};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

impl Manager {
    /// Validates runtime, template and limits of a create or a pool definition.
    pub(crate) async fn plan(
        &self,
        template: Option<&str>,
        runtime: Option<&str>,
        limits: &sandpit_api::LimitsSpec,
    ) -> Result<Plan, CoreError> {
        let runtime_name = runtime
            .map(str::to_string)
            .unwrap_or_else(|| self.cfg.default_runtime.clone());
        if runtime_name == "process" && !self.cfg.allow_process_runtime {
            return Err(CoreError::Forbidden(
                "the unisolated process runtime is disabled; start the daemon with --allow-process-runtime (development only)".into(),
            ));
        }
        let runtime = self.runtime(&runtime_name)?.clone();
        let template_name = template.unwrap_or("host").to_string();
        let (template, defaults) = self.templates.resolve(&self.store, &template_name).await?;
        let limits = Self::limits(limits)?;
        Ok(Plan {
            runtime,
            key: PoolKey {
                template: template_name,
                runtime: runtime_name,
                limits,
                sudo: false,
            },
            template,
            volumes: Vec::new(),
            defaults,
            network: None,
        })
    }

    /// Creates a sandbox and returns it running: a ready one from a matching warm pool
    /// when there is one, else started cold (on a snapshot's files when it names one).
    /// On any failure nothing is left behind.
    pub async fn create(
        self: &Arc<Self>,
        owner: &str,
        mut req: CreateSandboxRequest,
    ) -> Result<SandboxRecord, CoreError> {
        // A template built through E2B's build API belongs to the team that built it; to
        // anyone else it does not exist.
        if let Some(t) = req.template.as_deref()
            && self
                .store
                .e2b_build_owner(t)
                .await?
                .is_some_and(|o| o != owner)
        {
            return Err(CoreError::not_found(format!("template {t:?} not found")));
        }
        let secrets = std::mem::take(&mut req.secrets);
        self.broker.check_names(owner, &secrets).await?;
        let restore = match req.snapshot.as_deref() {
            Some(s) => Some(self.restore_plan(owner, s).await?),
            None => None,
        };
        if let Some(r) = &restore {
            let snap = &r.snapshot;
            if req.template.as_ref().is_some_and(|t| *t != snap.template)
                || req.runtime.as_ref().is_some_and(|t| *t != snap.runtime)
            {
                return Err(CoreError::invalid(format!(
                    "snapshot {} runs on template {:?} with runtime {:?}; leave them out",
                    snap.id, snap.template, snap.runtime
                )));
            }
            req.template = Some(snap.template.clone());
            req.runtime = Some(snap.runtime.clone());
            let l = &mut req.limits;
            l.cpu_millis = l.cpu_millis.or(r.limits.cpu_millis);
            l.memory_bytes = l.memory_bytes.or(r.limits.memory_bytes);
            l.disk_bytes = l.disk_bytes.or(r.limits.disk_bytes);
            l.max_processes = l.max_processes.or(r.limits.max_processes);
            let mut env = r.env.clone();
            env.append(&mut req.env);
            req.env = env;
            // What was secret when the snapshot was taken stays secret.
            req.secret_env.extend(r.secret_env.iter().cloned());
            req.workdir = req.workdir.take().or_else(|| r.workdir.clone());
            req.user = req.user.take().or_else(|| r.user.clone());
            req.network = req.network.take().or_else(|| r.network.clone());
        }
        let mut plan = self
            .plan(req.template.as_deref(), req.runtime.as_deref(), &req.limits)
            .await?;
        let req = crate::templates::with_defaults(req, &plan.defaults);
        crate::volumes::check_mounts(&req.volumes)?;
        plan.volumes = req.volumes.clone();
        // A pool's members were started without sudo; one who asks for it starts cold.
        plan.key.sudo = req.sudo.unwrap_or(false);
        plan.network =
            crate::net::plan_policy(self.net.get(), &plan.key.runtime, req.network.as_ref())?;
        let timeout = self.timeout(req.timeout)?;
        check_env(&req.env)?;
        let secret_env = check_secret_env(&req.env, &req.secret_env)?;
        check_metadata(&req.metadata)?;
        let workdir = req
            .workdir
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKDIR.into());
        if !workdir.starts_with('/')
            || workdir.contains('\0')
            || workdir.split('/').any(|c| c == "..")
        {
            return Err(CoreError::invalid(
                "workdir must be an absolute path without '..'",
            ));
        }
        if let Some(u) = &req.user
            && !matches!(u.as_str(), "user" | "root")
        {
            return Err(CoreError::invalid(format!(
                "unknown user {u:?}: sandboxes have `user` and `root`"
            )));
        }
        let on_timeout = match req.on_timeout.as_deref() {
            None | Some("kill") => sandpit_store::OnTimeout::Kill,
            Some("pause") => sandpit_store::OnTimeout::Pause,
            Some("hibernate") => sandpit_store::OnTimeout::Hibernate,
            Some(other) => {
                return Err(CoreError::invalid(format!(
                    "on_timeout is `kill`, `pause` or `hibernate`, not {other:?}"
                )));
            }
        };
        let life = sandpit_store::Lifecycle {
            layers: restore
                .as_ref()
                .map(|r| r.layers.clone())
                .unwrap_or_default(),
            snapshot: restore.as_ref().map(|r| r.snapshot.id.clone()),
            last_activity_ms: now_ms(),
            idle_timeout_secs: req
                .idle_timeout
                .unwrap_or(self.cfg.lifecycle.idle_timeout_secs),
            on_timeout,
            auto_resume: req.auto_resume.unwrap_or(true),
            paused_at_ms: None,
            workdir: (workdir != DEFAULT_WORKDIR).then(|| workdir.clone()),
            user: req.user.clone(),
            timeout_secs: timeout,
            sudo: req.sudo.unwrap_or(false),
        };
        let expires_at_ms = now_ms() + (timeout as i64) * 1000;
        let (secure, public) = (req.secure, req.public);
        // A pool's sandbox is running already and cannot get mounts any more.
        if restore.is_none()
            && plan.volumes.is_empty()
            && let Some(rec) = self
                .claim(owner, &plan.key, &req, &workdir, expires_at_ms, &life)
                .await
        {
            if let Err(e) = crate::net::assign(self.net.get(), &rec, plan.network.clone()).await {
                let _ = self.destroy(&rec).await;
                return Err(e.into());
            }
            let rec = self.with_proxy_access(rec, secure, public).await?;
            return self.with_secrets(rec, &secrets).await;
        }
        let rec = self
            .start_new(NewSandbox {
                owner,
                pool: None,
                plan,
                env: req.env,
                secret_env,
                metadata: req.metadata,
                workdir,
                expires_at_ms,
                life,
            })
            .await?;
        let rec = self.with_proxy_access(rec, secure, public).await?;
        self.with_secrets(rec, &secrets).await
    }

    /// Gives a new (or newly claimed) sandbox fresh proxy credentials; without them it goes.
    pub(crate) async fn with_proxy_access(
        &self,
        rec: SandboxRecord,
        secure: Option<bool>,
        public: Option<bool>,
    ) -> Result<SandboxRecord, CoreError> {
        if let Err(e) = crate::access::on_create(self, &rec.id, secure, public).await {
            let _ = self.destroy(&rec).await;
            return Err(e);
        }
        Ok(rec)
    }

    /// Starts a new sandbox cold and applies its default user.
    pub(crate) async fn start_new(&self, new: NewSandbox<'_>) -> Result<SandboxRecord, CoreError> {
        let user = new.life.user.clone();
        let rec = self.cold_create(new).await?;
        if let Some(user) = user.as_deref()
            && let Err(e) = self.set_default_user(&rec, user).await
        {
            let _ = self.destroy(&rec).await;
            return Err(e);
        }
        Ok(rec)
    }

    /// `POST /init` on the agent: the caller's env, default workdir and user.
    pub(crate) async fn init_agent(
        &self,
        rec: &SandboxRecord,
        init: &AgentInit<'_>,
    ) -> Result<(), CoreError> {
        if init.env.is_empty() && init.workdir.is_none() && init.user.is_none() {
            // Nothing to change: spare the caller a round trip.
            return Ok(());
        }
        let (_, h) = self.runtime_of(rec)?;
        let conn = self.conn_for(&rec.id, &h);
        let body = serde_json::json!({
            "envVars": init.env,
            "defaultWorkdir": init.workdir,
            "defaultUser": init.user,
        });
        conn.init(&body).await
    }

    /// Starts a sandbox from nothing and records it; on failure nothing is left behind.
    pub(crate) async fn cold_create(
        &self,
        new: NewSandbox<'_>,
    ) -> Result<SandboxRecord, CoreError> {
        let NewSandbox {
            owner,
            pool,
            plan,
            env,
            secret_env,
            metadata,
            workdir,
            expires_at_ms,
            life,
        } = new;
        let now = now_ms();
        let limits = plan.key.limits;
        let rec = SandboxRecord {
            id: new_id(),
            owner: owner.to_string(),
            template: plan.key.template.clone(),
            runtime: plan.key.runtime.clone(),
            state: SandboxState::Creating,
            cpu_millis: limits.cpu_millis as i64,
            memory_bytes: limits.memory_bytes as i64,
            disk_bytes: limits.disk_bytes as i64,
            max_processes: limits.max_processes as i64,
            env: env.clone(),
            secret_env,
            metadata,
            created_at_ms: now,
            updated_at_ms: now,
            expires_at_ms,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool,
            life,
        };
        let ca = self.broker.ca_pem_soon(&rec.id);
        self.store.insert_sandbox(&rec).await?;
        if let Err(e) = crate::net::assign(self.net.get(), &rec, plan.network.clone()).await {
            let _ = self.store.delete_sandbox(&rec.id).await;
            return Err(e.into());
        }
        let volumes = match self.attach_volumes(&rec.id, owner, &plan.volumes).await {
            Ok(v) => v,
            Err(e) => {
                let _ = self.store.delete_sandbox(&rec.id).await;
                return Err(e);
            }
        };
        let spec = SandboxSpec {
            id: rec.id.clone(),
            template: plan.template,
            limits: sandpit_runtime::Limits {
                cpu_millis: limits.cpu_millis,
                memory_bytes: limits.memory_bytes,
                disk_bytes: limits.disk_bytes,
                max_processes: limits.max_processes,
            },
            env,
            workdir,
            volumes,
            layers: self.start_layers(&rec, &plan.defaults)?,
            extra_ca_pem: ca.await,
            net: None,
            sudo: rec.life.sudo,
        };
        self.boot(&rec, plan.runtime, spec, Failed::Delete).await
    }

    /// Starts the runtime side of a record in `creating` and waits until its agent
    /// answers. On failure the runtime side is gone again, and the record is deleted or
    /// put back as `failed` says.
    pub(crate) async fn boot(
        &self,
        rec: &SandboxRecord,
        runtime: Arc<dyn Runtime>,
        spec: SandboxSpec,
        failed: Failed,
    ) -> Result<SandboxRecord, CoreError> {
        let forget_record = || async {
            match failed {
                Failed::Delete => {
                    let _ = self.store.delete_sandbox(&rec.id).await;
                }
                Failed::Restore(state) => {
                    let _ = self
                        .store
                        .transition(&rec.id, &[SandboxState::Creating], state, None)
                        .await;
                }
            }
        };
        let rt = runtime.clone();
        let created = tokio::task::spawn_blocking(move || {
            let mut h = rt.create(&spec)?;
            if let Err(e) = rt.start(&spec, &mut h) {
                if let Err(c) = rt.destroy(&h) {
                    tracing::error!(id = %spec.id, error = %c, "cleanup after a failed start");
                }
                return Err(e);
            }
            Ok(h)
        })
        .await;
        let handle = match created {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                forget_record().await;
                return Err(e.into());
            }
            Err(e) => {
                forget_record().await;
                return Err(CoreError::internal_from("the create task failed", e));
            }
        };
        let destroy_now = || async {
            let _ = run_destroy(runtime.clone(), handle.clone()).await;
            self.forget(&rec.id);
            forget_record().await;
        };
        let state = serde_json::to_value(&handle)?;
        if let Err(e) = self.store.set_runtime_state(&rec.id, &state).await {
            // Deleted before the handle was recorded: that delete could not tear the
            // sandbox down, so this create does.
            let _ = run_destroy(runtime.clone(), handle.clone()).await;
            self.forget(&rec.id);
            if matches!(failed, Failed::Delete) {
                let _ = self.store.delete_sandbox(&rec.id).await;
            }
            return Err(match e {
                sandpit_store::StoreError::NotFound(_) => {
                    CoreError::conflict("sandbox was deleted while it was being created")
                }
                other => other.into(),
            });
        }
        let ready = async {
            crate::templates::start_services(self, rec, &handle).await?;
            self.wait_ready(rec, &handle).await
        };
        match ready.await {
            Ok(r) => {
                crate::usage::on_state(self, &r, SandboxState::Running);
                Ok(r)
            }
            Err(e) => {
                // Whoever moves the record out of `creating` tears it down; if a delete
                // did, it holds the handle and does the work.
                let ours = match failed {
                    Failed::Delete => {
                        self.store
                            .transition(
                                &rec.id,
                                &[SandboxState::Creating],
                                SandboxState::Stopping,
                                None,
                            )
                            .await
                    }
                    Failed::Restore(_) => Ok(Some(rec.clone())),
                };
                if matches!(ours, Ok(Some(_)) | Err(_)) {
                    destroy_now().await;
                }
                Err(e)
            }
        }
    }

    /// Waits for the agent to answer, then marks the sandbox running.
    pub(crate) async fn wait_ready(
        &self,
        rec: &SandboxRecord,
        handle: &SandboxHandle,
    ) -> Result<SandboxRecord, CoreError> {
        let conn = self.conn_for(&rec.id, handle);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut delay = Duration::from_micros(200);
        let deleted = || CoreError::conflict("sandbox was deleted while it was being created");
        // An agent answers within milliseconds; only a slow one gets its record looked at
        // (every 100 ms), so that a delete meanwhile ends the wait without costing every
        // start a read of the store.
        let mut next_check = tokio::time::Instant::now() + Duration::from_millis(100);
        while !conn.healthy().await {
            let now = tokio::time::Instant::now();
            if now > deadline {
                return Err(CoreError::unavailable(
                    "the sandbox agent did not become ready",
                ));
            }
            if now >= next_check {
                next_check = now + Duration::from_millis(100);
                match self.store.get_sandbox(&rec.id).await? {
                    Some(r) if r.state == SandboxState::Creating => {}
                    _ => return Err(deleted()),
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(20));
        }
        self.store
            .transition(
                &rec.id,
                &[SandboxState::Creating],
                SandboxState::Running,
                None,
            )
            .await?
            .ok_or_else(deleted)
    }

    /// A sandbox's read-only layers at start: its own, then its template's.
    pub(crate) fn start_layers(
        &self,
        rec: &SandboxRecord,
        template: &crate::templates::Defaults,
    ) -> Result<Vec<std::path::PathBuf>, CoreError> {
        let mut layers = self.layer_paths(rec)?;
        layers.extend(template.layers.iter().cloned());
        Ok(layers)
    }

    /// Makes `user` the default user of a running sandbox's commands.
    pub(crate) async fn set_default_user(
        &self,
        rec: &SandboxRecord,
        user: &str,
    ) -> Result<(), CoreError> {
        let init = AgentInit {
            env: &BTreeMap::new(),
            workdir: None,
            user: Some(user),
        };
        self.init_agent(rec, &init).await
    }
}
