//! Running one E2B build. The base (a template, E2B's base image mapped onto the
//! daemon's `base` template, or a local OCI image imported as a template of its own) starts
//! a sandbox; RUN steps run in it as commands, COPY steps unpack the checked files into it,
//! ENV, USER and WORKDIR change what later steps get; the start and ready commands are
//! tried; then the sandbox's files become a sandpit template layered over the base (a
//! snapshot turned template, as `POST /v1/templates` with a snapshot source does), the
//! sandbox and snapshot go, and the build's tags point at it. Nothing of a step runs on
//! the host: the daemon only reads and rewrites the uploaded tar (`sandpit_image`).

use super::{BuildLog, PlanError, check_hash, sandpit_name, upload_path};
use crate::api::{AppState, Owner};
use crate::error::ApiError;
use http::StatusCode;
use sandpit_api::{
    BuildTemplateRequest, CreateSandboxRequest, CreateSnapshotRequest, LimitsSpec,
    RunCommandRequest, TemplateSourceSpec,
};
use sandpit_store::{E2bBuildRecord, E2bTemplateRecord, SandboxRecord};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The step name of E2B's base phase.
const BASE_STEP: &str = "base";
/// The step name of E2B's final phase (start and ready commands, the template made).
const FINALIZE_STEP: &str = "finalize";
/// Longest a RUN step may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest the ready command may keep failing at the end of a build, and in each sandbox
/// started from the template.
const READY_TIMEOUT_SECS: u32 = 120;
/// Output of a step kept for the log, per stream.
const STEP_OUTPUT: u64 = 1 << 20;
/// The images that stand for E2B's own base image (`Template().from_base_image()`).
const E2B_BASE_IMAGES: [&str; 4] = [
    "e2bdev/base",
    "e2bdev/base:latest",
    "docker.io/e2bdev/base",
    "docker.io/e2bdev/base:latest",
];

/// What a build starts from.
#[derive(Debug, Clone)]
pub enum Base {
    /// A sandpit template, by name.
    Template(String),
    /// A local OCI layout or `docker save` tarball, imported once as a template.
    Image { reference: String, path: PathBuf },
}

/// One checked step.
#[derive(Debug, Clone)]
pub enum Step {
    Run {
        cmd: String,
        user: Option<String>,
    },
    Copy {
        hash: String,
        src: String,
        dest: String,
        user: Option<String>,
        mode: Option<u32>,
    },
    Env(Vec<(String, String)>),
    User(String),
    Workdir(String),
}

/// A checked build: what [`run`] does.
#[derive(Debug, Clone)]
pub struct Plan {
    base: Base,
    steps: Vec<Step>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// Why a build failed, and at which step.
struct Failure {
    step: Option<String>,
    message: String,
}

impl Failure {
    fn at(step: &str, message: impl Into<String>) -> Self {
        Failure {
            step: Some(step.to_string()),
            message: message.into(),
        }
    }
}

/// The template name an imported image gets (one per image file, shared by builds).
pub fn image_template_name(path: &std::path::Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(path.as_os_str().as_encoded_bytes());
    format!("e2b-img-{}", &super::hex_encode(&digest)[..16])
}

fn user_part(u: &str) -> &str {
    u.split(':').next().unwrap_or("")
}

/// The sandbox account a step's user names: E2B templates have `user` and `root`.
fn account(u: &str) -> Option<&'static str> {
    match user_part(u) {
        "root" | "0" => Some("root"),
        "user" | "1000" => Some("user"),
        _ => None,
    }
}

/// `uid:gid` of a sandbox account, numeric: an image need not have an /etc/passwd.
fn ids_of(account: &str) -> String {
    if account == "root" {
        "0:0".into()
    } else {
        "1000:1000".into()
    }
}

fn check_text(step: &str, what: &str, s: &str, max: usize) -> Result<(), PlanError> {
    if s.is_empty() || s.len() > max || s.contains('\0') {
        return Err(PlanError::bad(
            Some(step.to_string()),
            format!("{what} must be non-empty, at most {max} bytes, without NUL"),
        ));
    }
    Ok(())
}

/// Checks a build request and decides its base; nothing is started.
pub(super) async fn plan(
    state: &AppState,
    owner: &Owner,
    template: &E2bTemplateRecord,
    req: super::StartBuild,
) -> Result<Plan, PlanError> {
    let base_err = |m: String| PlanError::bad(Some(BASE_STEP.into()), m);
    if req
        .from_image_registry
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(base_err(
            "fromImageRegistry is not supported: this sandpit daemon has no container registry \
             access. Use fromTemplate, E2B's base image (e2bdev/base), or an image the \
             daemon's [e2b] images config maps to a local OCI archive"
                .into(),
        ));
    }
    let base = match (&req.from_template, &req.from_image) {
        (Some(t), _) => base_template(state, owner, t).await.map_err(base_err)?,
        (None, Some(img)) => base_image(state, owner, img).map_err(base_err)?,
        (None, None) => {
            return Err(base_err("a build needs fromImage or fromTemplate".into()));
        }
    };
    if req.steps.len() > super::MAX_STEPS {
        return Err(PlanError::bad(
            None,
            format!("a build has at most {} steps", super::MAX_STEPS),
        ));
    }
    let mut steps = Vec::new();
    for (i, s) in req.steps.iter().enumerate() {
        let name = (i + 1).to_string();
        let bad = |m: String| PlanError::bad(Some(name.clone()), m);
        let arg = |n: usize| s.args.get(n).map(String::as_str).unwrap_or("");
        let step = match s.kind.as_str() {
            "RUN" => {
                check_text(&name, "a RUN command", arg(0), 256 << 10)?;
                let user = s.args.get(1).filter(|u| !u.is_empty()).cloned();
                Step::Run {
                    cmd: arg(0).to_string(),
                    user,
                }
            }
            "COPY" => {
                let hash = s.files_hash.clone().unwrap_or_default();
                check_hash(&hash).map_err(|_| bad("a COPY step needs its filesHash".into()))?;
                if !upload_path(state, &template.id, &hash).is_file() {
                    return Err(bad(format!(
                        "the files of COPY {} were not uploaded (files hash {hash})",
                        arg(0)
                    )));
                }
                check_text(&name, "a COPY source", arg(0), 4096)?;
                check_text(&name, "a COPY destination", arg(1), 4096)?;
                let user = Some(arg(2)).filter(|u| !u.is_empty()).map(String::from);
                if let Some(u) = &user
                    && account(u).is_none()
                {
                    return Err(bad(format!(
                        "COPY user {u:?} is unknown: sandboxes have `user` and `root`"
                    )));
                }
                let mode = match arg(3) {
                    "" => None,
                    m => Some(
                        u32::from_str_radix(m, 8)
                            .ok()
                            .filter(|v| *v <= 0o7777)
                            .ok_or_else(|| bad(format!("invalid COPY mode {m:?}")))?,
                    ),
                };
                Step::Copy {
                    hash,
                    src: arg(0).to_string(),
                    dest: arg(1).to_string(),
                    user,
                    mode,
                }
            }
            "ENV" => {
                if s.args.len() % 2 != 0 || s.args.is_empty() {
                    return Err(bad("ENV takes name and value pairs".into()));
                }
                let pairs: Vec<(String, String)> = s
                    .args
                    .chunks(2)
                    .map(|c| (c[0].clone(), c[1].clone()))
                    .collect();
                let env: BTreeMap<String, String> = pairs.iter().cloned().collect();
                crate::manager::check_env(&env).map_err(|e| bad(e.to_string()))?;
                Step::Env(pairs)
            }
            "USER" => {
                let u = arg(0);
                match account(u) {
                    Some(a) => Step::User(a.to_string()),
                    None => {
                        return Err(bad(format!(
                            "USER {u:?} is unknown: sandboxes have the accounts `user` and `root`"
                        )));
                    }
                }
            }
            "WORKDIR" => {
                check_text(&name, "WORKDIR", arg(0), 4096)?;
                Step::Workdir(arg(0).to_string())
            }
            other => {
                return Err(bad(format!(
                    "unsupported step type {other:?}: sandpit builds RUN, COPY, ENV, USER and WORKDIR"
                )));
            }
        };
        steps.push(step);
    }
    for (what, c) in [("startCmd", &req.start_cmd), ("readyCmd", &req.ready_cmd)] {
        if let Some(c) = c {
            check_text(FINALIZE_STEP, what, c, 16 << 10)?;
        }
    }
    let _ = req.force;
    Ok(Plan {
        base,
        steps,
        start_cmd: req.start_cmd,
        ready_cmd: req.ready_cmd,
    })
}

/// `fromTemplate`: one of the caller's E2B templates (`name[:tag]`), a configured alias
/// (`base`), or a sandpit template.
async fn base_template(state: &AppState, owner: &Owner, t: &str) -> Result<Base, String> {
    if let Some(name) = super::resolve(state, &owner.0, t)
        .await
        .map_err(|e| e.0.message)?
    {
        return Ok(Base::Template(name));
    }
    if let Some(target) = state.e2b.templates.get(t) {
        return Ok(Base::Template(target.clone()));
    }
    if t == "host" {
        return Ok(Base::Template(t.into()));
    }
    let theirs = state
        .store
        .e2b_build_owner(t)
        .await
        .map_err(|e| e.to_string())?
        .is_some_and(|o| o != owner.0);
    match state.store.get_template(t).await {
        Ok(Some(_)) if !theirs => Ok(Base::Template(t.into())),
        Ok(_) => Err(format!("template {t} not found")),
        Err(e) => Err(e.to_string()),
    }
}

/// `fromImage`: E2B's base image, an image the `[e2b] images` config maps, or (admin
/// only) the path of a local OCI archive. Anything else would need a registry.
fn base_image(state: &AppState, owner: &Owner, img: &str) -> Result<Base, String> {
    if E2B_BASE_IMAGES.contains(&img) {
        let base = state
            .e2b
            .templates
            .get("base")
            .cloned()
            .unwrap_or_else(|| "host".into());
        return Ok(Base::Template(base));
    }
    let local = |path: &str| {
        if path.starts_with('/') {
            Base::Image {
                reference: img.to_string(),
                path: PathBuf::from(path),
            }
        } else {
            Base::Template(path.to_string())
        }
    };
    if let Some(to) = state.e2b.images.get(img) {
        return Ok(local(to));
    }
    if img.starts_with('/') && owner.0 == crate::api::pools::ADMIN_OWNER {
        return Ok(local(img));
    }
    let configured: Vec<&str> = state.e2b.images.keys().map(String::as_str).collect();
    Err(format!(
        "the image {img:?} cannot be pulled: this sandpit daemon has no container registry \
         access. What works: E2B's base image (Template().from_base_image(), e2bdev/base, \
         which is this daemon's `{}` template), fromTemplate with a template name, {}or \
         (admin key) the absolute path of a local OCI layout or docker-save tarball",
        state
            .e2b
            .templates
            .get("base")
            .map_or("host", String::as_str),
        if configured.is_empty() {
            "an image the daemon's [e2b] images config maps to a local OCI archive (none are configured), ".to_string()
        } else {
            format!(
                "the images the daemon's [e2b] images config maps ({}), ",
                configured.join(", ")
            )
        }
    ))
}

/// Runs a planned build to its end and records the outcome.
pub(super) async fn run(
    state: AppState,
    owner: String,
    template: E2bTemplateRecord,
    build: E2bBuildRecord,
    plan: Plan,
    log: Arc<BuildLog>,
) {
    let mut job = Job {
        state: state.clone(),
        owner,
        template,
        build: build.clone(),
        log: log.clone(),
        sandbox: None,
        snapshot: None,
        made: None,
        on_host: false,
    };
    let outcome = job.execute(&plan).await;
    job.cleanup().await;
    match outcome {
        Ok(name) => {
            log.info(None, format!("template {} is ready", job.template.name));
            if let Err(e) = state.store.e2b_finish_build(&build, true, None, None).await {
                tracing::warn!(build = %build.id, error = %e, "recording a finished build failed");
            }
            tracing::info!(build = %build.id, template = %name, "E2B template built");
        }
        Err(f) => {
            log.push("error", f.step.as_deref(), f.message.clone());
            tracing::info!(build = %build.id, error = %f.message, "E2B template build failed");
            if let Some(name) = job.made.take() {
                let gone = state.manager.templates().delete(&state.store, &name).await;
                if let Err(e) = gone {
                    tracing::warn!(template = %name, error = %e.chain(), "removing a failed build's template failed");
                }
            }
            if let Err(e) = state
                .store
                .e2b_finish_build(&build, false, Some(&f.message), f.step.as_deref())
                .await
            {
                tracing::warn!(build = %build.id, error = %e, "recording a failed build failed");
            }
        }
    }
    log.finish();
}

struct Job {
    state: AppState,
    owner: String,
    template: E2bTemplateRecord,
    build: E2bBuildRecord,
    log: Arc<BuildLog>,
    sandbox: Option<SandboxRecord>,
    snapshot: Option<String>,
    /// The sandpit template this build started making.
    made: Option<String>,
    /// Whether the base is (layered over) the `host` template, whose top level is
    /// read-only.
    on_host: bool,
}

/// What a step sees: the account, directory and env earlier steps set.
struct Context {
    user: String,
    workdir: String,
    env: BTreeMap<String, String>,
}

impl Context {
    fn path(&self, p: &str) -> String {
        if p.starts_with('/') {
            p.to_string()
        } else {
            format!("{}/{p}", self.workdir.trim_end_matches('/'))
        }
    }
}

impl Job {
    /// Why a path outside the writable places fails on a `host` base.
    fn host_hint(&self) -> &'static str {
        if self.on_host {
            " (the base is the `host` template, whose top level is read-only: use a path \
             under /home/user, /opt, /var, /mnt or /tmp, or map [e2b] templates `base` to a \
             root filesystem template)"
        } else {
            ""
        }
    }

    fn info(&self, step: &str, m: impl Into<String>) {
        self.log.info(Some(step), m);
    }

    async fn execute(&mut self, plan: &Plan) -> Result<String, Failure> {
        let base = self.prepare_base(&plan.base).await?;
        self.info(BASE_STEP, format!("[base] FROM template {base}"));
        self.on_host = matches!(
            self.state
                .manager
                .templates()
                .resolve(&self.state.store, &base)
                .await,
            Ok((sandpit_runtime::TemplateSource::Host, _))
        );
        let rec = self.start_sandbox(&base).await?;
        let mut ctx = Context {
            user: "user".into(),
            workdir: crate::manager::DEFAULT_WORKDIR.into(),
            env: BTreeMap::new(),
        };
        let total = plan.steps.len();
        for (i, step) in plan.steps.iter().enumerate() {
            let name = (i + 1).to_string();
            self.step(&rec, &mut ctx, &name, total, step).await?;
        }
        self.finalize(&rec, &ctx, plan).await
    }

    /// The base as a sandpit template, importing an image first when it is one.
    async fn prepare_base(&mut self, base: &Base) -> Result<String, Failure> {
        let (reference, path) = match base {
            Base::Template(t) => return Ok(t.clone()),
            Base::Image { reference, path } => (reference, path),
        };
        let name = image_template_name(path);
        let fail = |m: String| Failure::at(BASE_STEP, m);
        let templates = self.state.manager.templates();
        loop {
            match self.state.store.get_template(&name).await {
                Ok(Some(t)) if t.state == sandpit_store::TemplateState::Ready => {
                    self.info(
                        BASE_STEP,
                        format!("[base] the image {reference} was imported before ({name})"),
                    );
                    return Ok(name);
                }
                Ok(Some(t)) if t.state == sandpit_store::TemplateState::Building => {
                    self.follow(BASE_STEP, &name).await.map_err(fail)?;
                }
                Ok(Some(_)) => {
                    // A failed import is tried again.
                    templates
                        .delete(&self.state.store, &name)
                        .await
                        .map_err(|e| fail(e.chain()))?;
                }
                Ok(None) => {
                    self.info(
                        BASE_STEP,
                        format!(
                            "[base] importing the image {reference} from {}",
                            path.display()
                        ),
                    );
                    let req = BuildTemplateRequest {
                        name: name.clone(),
                        source: TemplateSourceSpec::Oci {
                            path: path.to_string_lossy().into_owned(),
                        },
                        default_user: None,
                        workdir: None,
                        env: BTreeMap::new(),
                        start_cmd: None,
                        ready_cmd: None,
                        ready_timeout_secs: None,
                    };
                    match templates.build(&self.state.store, req, None).await {
                        Ok(_) => {}
                        // Another build started the same import meanwhile.
                        Err(sandpit_core::CoreError::Conflict(_)) => continue,
                        Err(e) => {
                            return Err(fail(format!("importing {reference}: {}", e.chain())));
                        }
                    }
                    self.follow(BASE_STEP, &name).await.map_err(fail)?;
                }
                Err(e) => return Err(fail(e.to_string())),
            }
        }
    }

    /// Follows a sandpit template build to its end, copying its log.
    async fn follow(&self, step: &str, name: &str) -> Result<(), String> {
        let mut offset = 0;
        loop {
            let b = self
                .state
                .manager
                .templates()
                .progress(&self.state.store, name, offset, Duration::from_secs(10))
                .await
                .map_err(|e| e.chain())?;
            for l in &b.lines {
                self.log.push("debug", Some(step), l.text.clone());
            }
            offset = b.next_offset;
            match b.state.as_str() {
                "building" => continue,
                "ready" => return Ok(()),
                _ => {
                    return Err(b
                        .error
                        .unwrap_or_else(|| format!("building template {name} failed")));
                }
            }
        }
    }

    async fn start_sandbox(&mut self, base: &str) -> Result<SandboxRecord, Failure> {
        let fail = |m: String| Failure::at(BASE_STEP, m);
        let state = &self.state;
        let max = state.manager.config().max_timeout_secs;
        let network = state
            .manager
            .net()
            .filter(|_| state.e2b.internet_by_default)
            .map(|_| sandpit_api::NetworkPolicy {
                mode: sandpit_api::NetworkMode::Open,
                rules: Vec::new(),
            });
        let req = CreateSandboxRequest {
            template: Some(base.to_string()),
            timeout: Some(max.clamp(60, 3 * 3600)),
            limits: LimitsSpec {
                cpu_millis: u64::try_from(self.template.cpu_count * 1000).ok(),
                memory_bytes: u64::try_from(self.template.memory_mb << 20).ok(),
                ..Default::default()
            },
            metadata: [("e2b.build".to_string(), self.build.id.clone())].into(),
            idle_timeout: Some(0),
            auto_resume: Some(false),
            sudo: Some(state.e2b.sudo),
            network,
            ..Default::default()
        };
        let rec = state
            .manager
            .create(&self.owner, req)
            .await
            .map_err(|e| fail(format!("starting a sandbox of {base}: {}", e.chain())))?;
        self.info(BASE_STEP, format!("[base] building in sandbox {}", rec.id));
        self.sandbox = Some(rec.clone());
        Ok(rec)
    }

    async fn conn(
        &self,
        rec: &SandboxRecord,
        step: &str,
    ) -> Result<Arc<crate::agent_conn::AgentConn>, Failure> {
        self.state
            .manager
            .agent(&self.owner, &rec.id)
            .await
            .map(|(_, c)| c)
            .map_err(|e| Failure::at(step, format!("the build sandbox: {}", e.chain())))
    }

    /// Runs a shell command in the build sandbox; its output goes to the log.
    #[allow(clippy::too_many_arguments)]
    async fn shell(
        &self,
        rec: &SandboxRecord,
        step: &str,
        ctx: &Context,
        cmd: &str,
        user: &str,
        env: BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<sandpit_api::RunCommandResponse, Failure> {
        let conn = self.conn(rec, step).await?;
        // bash when the template has it (E2B runs steps in bash), else sh.
        let req = RunCommandRequest {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "if [ -x /bin/bash ]; then exec /bin/bash -c \"$1\"; else exec /bin/sh -c \"$1\"; fi"
                    .into(),
                "sh".into(),
                cmd.into(),
            ],
            env,
            cwd: Some(ctx.workdir.clone()),
            user: Some(user.to_string()),
            timeout_ms: Some(timeout.as_millis() as u64),
            max_output_bytes: Some(STEP_OUTPUT),
            ..Default::default()
        };
        self.stream(&conn, &req, step).await.map_err(|e| {
            Failure::at(
                step,
                format!("failed to run command '{cmd}': {}", e.chain()),
            )
        })
    }

    /// Runs a command to its end, putting its output in the build log line by line as it
    /// comes; what the result keeps of each stream is bounded.
    async fn stream(
        &self,
        conn: &crate::agent_conn::AgentConn,
        req: &RunCommandRequest,
        step: &str,
    ) -> Result<sandpit_api::RunCommandResponse, sandpit_core::CoreError> {
        use sandpit_proto::process::__buffa::oneof::process_event::Event;
        use sandpit_proto::process::__buffa::oneof::process_event::data_event::Output;
        use sandpit_proto::process::StartResponse;
        let started = std::time::Instant::now();
        let (pid, mut events) = crate::exec::start(conn, req, false).await?;
        let deadline = req
            .timeout_ms
            .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
        // Partial lines of stdout and stderr, and what the answer keeps of each.
        let (mut partial, mut kept) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        let (mut exit_code, mut timed_out) = (-1, false);
        loop {
            let next = match deadline {
                Some(d) if !timed_out => {
                    match tokio::time::timeout_at(d, events.message::<StartResponse>()).await {
                        Ok(m) => m,
                        Err(_) => {
                            timed_out = true;
                            crate::exec::kill(conn, pid).await;
                            continue;
                        }
                    }
                }
                _ => events.message::<StartResponse>().await,
            };
            let Some(msg) = next? else { break };
            match (*msg.to_owned_message().event).clone().event {
                Some(Event::Data(d)) => {
                    let (i, chunk) = match d.output {
                        Some(Output::Stdout(b)) => (0, b),
                        Some(Output::Stderr(b)) | Some(Output::Pty(b)) => (1, b),
                        None => continue,
                    };
                    let room = (STEP_OUTPUT as usize).saturating_sub(kept[i].len());
                    kept[i].extend_from_slice(&chunk[..chunk.len().min(room)]);
                    partial[i].extend_from_slice(&chunk);
                    while let Some(nl) = partial[i].iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = partial[i].drain(..=nl).collect();
                        self.log.push(
                            "info",
                            Some(step),
                            String::from_utf8_lossy(&line[..line.len() - 1]).into_owned(),
                        );
                    }
                    // A line with no end in sight is logged in pieces.
                    if partial[i].len() > super::MAX_LOG_LINE {
                        let line: Vec<u8> = std::mem::take(&mut partial[i]);
                        self.log.push(
                            "info",
                            Some(step),
                            String::from_utf8_lossy(&line).into_owned(),
                        );
                    }
                }
                Some(Event::End(e)) => {
                    exit_code = e.exit_code;
                    break;
                }
                _ => {}
            }
        }
        for rest in partial.iter().filter(|p| !p.is_empty()) {
            self.log.push(
                "info",
                Some(step),
                String::from_utf8_lossy(rest).into_owned(),
            );
        }
        let [out, err] = kept;
        Ok(sandpit_api::RunCommandResponse {
            pid,
            exit_code,
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
            duration_ms: started.elapsed().as_millis() as u64,
            truncated: false,
            timed_out,
        })
    }

    async fn step(
        &self,
        rec: &SandboxRecord,
        ctx: &mut Context,
        name: &str,
        total: usize,
        step: &Step,
    ) -> Result<(), Failure> {
        let head = format!("[builder {name}/{total}]");
        match step {
            Step::Run { cmd, user } => {
                self.info(name, format!("{head} RUN {cmd}"));
                let user = match user {
                    None => ctx.user.clone(),
                    Some(u) => match account(u) {
                        Some(a) => a.to_string(),
                        None => {
                            return Err(Failure::at(
                                name,
                                format!(
                                    "failed to run command '{cmd}': command failed: unauthenticated: invalid username: '{u}'"
                                ),
                            ));
                        }
                    },
                };
                let r = self
                    .shell(rec, name, ctx, cmd, &user, ctx.env.clone(), STEP_TIMEOUT)
                    .await?;
                if r.timed_out {
                    return Err(Failure::at(
                        name,
                        format!(
                            "failed to run command '{cmd}': it ran longer than {} s",
                            STEP_TIMEOUT.as_secs()
                        ),
                    ));
                }
                if r.exit_code != 0 {
                    let mut tail = r.stderr.lines().last().unwrap_or("").to_string();
                    if tail.contains("ermission denied") || tail.contains("Read-only file system") {
                        tail.push_str(self.host_hint());
                    }
                    return Err(Failure::at(
                        name,
                        format!(
                            "failed to run command '{cmd}': command failed: exit status {}{}",
                            r.exit_code,
                            if tail.is_empty() {
                                String::new()
                            } else {
                                format!(": {tail}")
                            }
                        ),
                    ));
                }
                Ok(())
            }
            Step::Copy {
                hash,
                src,
                dest,
                user,
                mode,
            } => {
                self.info(name, format!("{head} COPY {src} {dest}"));
                let owner = user
                    .as_deref()
                    .and_then(account)
                    .unwrap_or(ctx.user.as_str())
                    .to_string();
                self.copy(rec, ctx, name, hash, src, dest, &owner, *mode)
                    .await
            }
            Step::Env(pairs) => {
                let shown: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
                self.info(name, format!("{head} ENV {}", shown.join(" ")));
                ctx.env.extend(pairs.iter().cloned());
                Ok(())
            }
            Step::User(u) => {
                self.info(name, format!("{head} USER {u}"));
                ctx.user = u.clone();
                Ok(())
            }
            Step::Workdir(w) => {
                let w = ctx.path(w);
                self.info(name, format!("{head} WORKDIR {w}"));
                let mut env = BTreeMap::new();
                env.insert("SP_DIR".to_string(), w.clone());
                env.insert("SP_OWNER".to_string(), ids_of(&ctx.user));
                // Run from `/`: the directory may not exist yet.
                let root = Context {
                    user: "root".into(),
                    workdir: "/".into(),
                    env: BTreeMap::new(),
                };
                let r = self
                    .shell(
                        rec,
                        name,
                        &root,
                        "[ -d \"$SP_DIR\" ] || { mkdir -p \"$SP_DIR\" && chown \"$SP_OWNER\" \"$SP_DIR\"; }",
                        "root",
                        env,
                        Duration::from_secs(60),
                    )
                    .await?;
                if r.exit_code != 0 {
                    return Err(Failure::at(
                        name,
                        format!(
                            "WORKDIR {w} could not be made: {}{}",
                            r.stderr.trim(),
                            self.host_hint()
                        ),
                    ));
                }
                ctx.workdir = w;
                Ok(())
            }
        }
    }

    /// A COPY step: the upload is checked and rewritten on the daemon (never unpacked on
    /// the host), sent into the sandbox, and unpacked there by `tar` as root.
    #[allow(clippy::too_many_arguments)]
    async fn copy(
        &self,
        rec: &SandboxRecord,
        ctx: &Context,
        step: &str,
        hash: &str,
        src: &str,
        dest: &str,
        owner: &str,
        mode: Option<u32>,
    ) -> Result<(), Failure> {
        let fail = |m: String| Failure::at(step, m);
        let upload = upload_path(&self.state, &self.template.id, hash);
        let staged = upload.with_file_name(format!(
            ".copy-{}-{step}.tar",
            self.build.id.replace('-', "")
        ));
        let id = if owner == "root" { 0 } else { 1000 };
        let (src_owned, staged2) = (src.to_string(), staged.clone());
        let selected = tokio::task::spawn_blocking(move || {
            let input = std::fs::File::open(&upload).map_err(|e| format!("the upload: {e}"))?;
            let out = std::fs::File::create(&staged2).map_err(|e| format!("staging: {e}"))?;
            let spec = sandpit_image::CopySpec {
                pattern: &src_owned,
                uid: id,
                gid: id,
                mode,
            };
            sandpit_image::select_context(
                std::io::BufReader::new(input),
                std::io::BufWriter::new(out),
                &spec,
                &sandpit_image::ContextLimits::default(),
            )
            .map_err(|e| format!("the files of COPY {src_owned}: {e}"))
        })
        .await
        .map_err(|e| fail(format!("copy task: {e}")))
        .and_then(|r| r.map_err(fail));
        let selected = match selected {
            Ok(s) => s,
            Err(e) => {
                let _ = tokio::fs::remove_file(&staged).await;
                return Err(e);
            }
        };
        self.log.push(
            "debug",
            Some(step),
            format!(
                "{} of {} members selected ({} bytes)",
                selected.written, selected.entries, selected.bytes
            ),
        );
        let inside = format!("/tmp/.sandpit-copy-{}.tar", uuid::Uuid::new_v4().simple());
        let sent = self.send_file(rec, step, &staged, &inside).await;
        let _ = tokio::fs::remove_file(&staged).await;
        sent?;
        let dest = ctx.path(dest);
        let mut env = BTreeMap::new();
        env.insert("SP_ARCHIVE".to_string(), inside);
        env.insert("SP_DEST".to_string(), dest.clone());
        env.insert("SP_OWNER".to_string(), ids_of(owner));
        env.insert(
            "SP_SINGLE".to_string(),
            selected.single_file.unwrap_or_default(),
        );
        // One file lands at the destination path itself unless that is (or ends like) a
        // directory; everything else lands inside the destination directory.
        let script = r#"set -e
a="$SP_ARCHIVE"; d="$SP_DEST"
trap 'rm -f "$a"' EXIT
command -v tar >/dev/null 2>&1 || { echo "COPY needs tar in the template" >&2; exit 127; }
if [ -n "$SP_SINGLE" ] && [ ! -d "$d" ] && [ "${d%/}" = "$d" ]; then
  p=$(dirname "$d")
  [ -d "$p" ] || { mkdir -p "$p"; chown "$SP_OWNER" "$p"; }
  t=$(mktemp -d)
  tar -xpf "$a" -C "$t"
  rm -rf "$d"
  mv "$t/$SP_SINGLE" "$d"
  rmdir "$t"
else
  [ -d "$d" ] || { mkdir -p "$d"; chown "$SP_OWNER" "$d"; }
  tar -xpf "$a" -C "$d"
fi"#;
        let root = Context {
            user: "root".into(),
            workdir: "/".into(),
            env: BTreeMap::new(),
        };
        let r = self
            .shell(
                rec,
                step,
                &root,
                script,
                "root",
                env,
                Duration::from_secs(600),
            )
            .await?;
        if r.exit_code != 0 {
            return Err(fail(format!(
                "COPY {src} {dest} failed: {}{}",
                r.stderr.trim(),
                self.host_hint()
            )));
        }
        Ok(())
    }

    /// Writes a host file into the sandbox as root through the agent's `/files`.
    async fn send_file(
        &self,
        rec: &SandboxRecord,
        step: &str,
        from: &std::path::Path,
        to: &str,
    ) -> Result<(), Failure> {
        use http_body_util::BodyExt;
        let fail = |m: String| Failure::at(step, m);
        let conn = self.conn(rec, step).await?;
        let file = tokio::fs::File::open(from)
            .await
            .map_err(|e| fail(format!("staged files: {e}")))?;
        let stream = tokio_util::io::ReaderStream::new(file);
        let body = http_body_util::StreamBody::new(futures::StreamExt::map(stream, |r| {
            r.map(hyper::body::Frame::data)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        }))
        .boxed_unsync();
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("path", to)
            .append_pair("username", "root")
            .finish();
        let req = http::Request::post(format!("{}/files?{query}", crate::agent_conn::AGENT_BASE))
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .map_err(|e| fail(format!("upload request: {e}")))?;
        let answer = tokio::time::timeout(Duration::from_secs(600), conn.http.request(req))
            .await
            .map_err(|_| fail("the sandbox did not take the files in time".into()))?
            .map_err(|e| fail(format!("sending the files into the sandbox: {e}")))?;
        if !answer.status().is_success() {
            return Err(fail(format!(
                "the sandbox refused the files: {}",
                answer.status()
            )));
        }
        Ok(())
    }

    /// Tries the start and ready commands, then makes the template from the sandbox.
    async fn finalize(
        &mut self,
        rec: &SandboxRecord,
        ctx: &Context,
        plan: &Plan,
    ) -> Result<String, Failure> {
        let step = FINALIZE_STEP;
        let fail = |m: String| Failure::at(step, m);
        if let Some(cmd) = &plan.start_cmd {
            self.info(step, format!("[finalize] start command: {cmd}"));
            let conn = self.conn(rec, step).await?;
            let req = RunCommandRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), cmd.clone()],
                env: ctx.env.clone(),
                cwd: Some(ctx.workdir.clone()),
                user: Some(ctx.user.clone()),
                background: true,
                tag: Some("template-start".into()),
                ..Default::default()
            };
            crate::exec::start(&conn, &req, false)
                .await
                .map_err(|e| fail(format!("the start command could not start: {}", e.chain())))?;
        }
        if let Some(check) = &plan.ready_cmd {
            self.info(step, format!("[finalize] ready command: {check}"));
            let deadline =
                tokio::time::Instant::now() + Duration::from_secs(READY_TIMEOUT_SECS.into());
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Err(fail(format!(
                        "the ready command did not succeed within {READY_TIMEOUT_SECS} s"
                    )));
                }
                let r = self
                    .shell(rec, step, ctx, check, &ctx.user, ctx.env.clone(), left)
                    .await?;
                if r.exit_code == 0 && !r.timed_out {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500).min(left)).await;
            }
        }
        self.info(step, "[finalize] saving the template's files");
        let snap = self
            .state
            .manager
            .snapshot(
                rec,
                &CreateSnapshotRequest {
                    name: Some(format!("e2b-build-{}", self.build.id)),
                    incremental: false,
                },
            )
            .await
            .map_err(|e| fail(format!("capturing the sandbox's files: {}", e.chain())))?;
        self.snapshot = Some(snap.id.clone());
        let name = sandpit_name(&self.template.id, &self.build.id);
        let req = BuildTemplateRequest {
            name: name.clone(),
            source: TemplateSourceSpec::Snapshot {
                snapshot: snap.id.clone(),
                base: None,
            },
            default_user: Some(ctx.user.clone()),
            workdir: Some(ctx.workdir.clone()),
            env: BTreeMap::new(),
            start_cmd: plan.start_cmd.clone(),
            ready_cmd: plan.ready_cmd.clone(),
            ready_timeout_secs: plan.ready_cmd.as_ref().map(|_| READY_TIMEOUT_SECS),
        };
        let (req, prepared) = self
            .state
            .manager
            .snapshot_template_source(&self.owner, &snap.id, req)
            .await
            .map_err(|e| fail(e.chain()))?;
        self.state
            .store
            .e2b_set_build_template(&self.build.id, &name)
            .await
            .map_err(|e| fail(e.to_string()))?;
        self.made = Some(name.clone());
        self.state
            .manager
            .templates()
            .build(&self.state.store, req, prepared)
            .await
            .map_err(|e| fail(e.chain()))?;
        self.follow(step, &name).await.map_err(fail)?;
        Ok(name)
    }

    /// Removes the build sandbox and the snapshot, whatever the outcome.
    async fn cleanup(&mut self) {
        if let Some(rec) = self.sandbox.take()
            && let Err(e) = self.state.manager.destroy(&rec).await
        {
            tracing::warn!(sandbox = %rec.id, error = %e.chain(), "removing a build sandbox failed");
        }
        if let Some(id) = self.snapshot.take()
            && let Err(e) = self
                .state
                .manager
                .delete_snapshot(&self.owner, &id, false)
                .await
        {
            tracing::warn!(snapshot = %id, error = %e.chain(), "removing a build snapshot failed");
        }
    }
}

impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "build_failed", f.message)
    }
}
