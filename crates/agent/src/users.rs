//! The two accounts every sandbox has. In a container the agent can switch to them; in the
//! process runtime both map onto the daemon's own uid.

use crate::config::{AgentConfig, IsolationMode};
use base64::Engine;
use std::path::PathBuf;

/// A resolved account that a command or file operation acts as.
#[derive(Debug, Clone)]
pub struct User {
    pub name: &'static str,
    pub uid: u32,
    pub gid: u32,
    /// Home directory as seen inside the sandbox.
    pub home: &'static str,
    /// Whether the agent must switch uid/gid before running as this user.
    pub switch: bool,
}

pub use sandpit_abi::{ROOT_UID, USER_UID};

/// Resolves a user name from the API; `None` means an unknown user.
pub fn resolve(cfg: &AgentConfig, name: Option<&str>) -> Option<User> {
    let default = cfg.default_user();
    let name = match name {
        None | Some("") => default.as_deref().unwrap_or("user"),
        Some(n) => n,
    };
    let (name, uid, home) = match name {
        "root" => ("root", ROOT_UID, "/root"),
        "user" => ("user", USER_UID, "/home/user"),
        _ => return None,
    };
    Some(match cfg.mode {
        IsolationMode::Container => User {
            name,
            uid,
            gid: uid,
            home,
            switch: true,
        },
        IsolationMode::Process => {
            let me = nix::unistd::getuid().as_raw();
            let gid = nix::unistd::getgid().as_raw();
            User {
                name,
                uid: me,
                gid,
                home,
                switch: false,
            }
        }
    })
}

/// Reads the user named by E2B's `Authorization: Basic base64("<user>:")` header.
pub fn from_headers(headers: &http::HeaderMap) -> Option<String> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    Some(text.split(':').next().unwrap_or_default().to_string())
}

/// Name shown for a file owner uid.
pub fn name_of(cfg: &AgentConfig, uid: u32) -> String {
    match cfg.mode {
        IsolationMode::Container => match uid {
            ROOT_UID => "root".into(),
            USER_UID => "user".into(),
            other => other.to_string(),
        },
        IsolationMode::Process => {
            if uid == nix::unistd::getuid().as_raw() {
                "user".into()
            } else {
                uid.to_string()
            }
        }
    }
}

/// Maps an in-sandbox absolute path to the path a host process must use.
pub fn host_path(cfg: &AgentConfig, inside: &str) -> PathBuf {
    match cfg.mode {
        IsolationMode::Container => PathBuf::from(inside),
        IsolationMode::Process => cfg.root.join(inside.trim_start_matches('/')),
    }
}

/// Runs filesystem work with `user`'s file-system identity on this thread, so the kernel
/// checks permissions as that user (setfsuid is per thread and is restored afterwards).
pub fn as_fs_user<T>(user: &User, f: impl FnOnce() -> T) -> T {
    if !user.switch || user.uid == 0 {
        return f();
    }
    // SAFETY: setfsgid/setfsuid only change this thread's file-system credentials.
    unsafe {
        libc::setfsgid(user.gid);
        libc::setfsuid(user.uid);
    }
    let out = f();
    // SAFETY: as above; back to the agent's own identity for the next task on this thread.
    unsafe {
        libc::setfsuid(0);
        libc::setfsgid(0);
    }
    out
}
