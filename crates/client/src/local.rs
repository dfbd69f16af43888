//! Where a daemon on this machine keeps its state, and the admin key it leaves there: the
//! CLI and the benchmark find a local daemon's key without being told.

use std::path::{Path, PathBuf};

/// `/var/lib/sandpit` for root, else `$HOME/.local/share/sandpit` (or `./.sandpit`
/// without a home): the daemon's default data directory.
pub fn default_data_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/lib/sandpit");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".local/share/sandpit"),
        None => PathBuf::from(".sandpit"),
    }
}

/// The first admin key a daemon left in `data_dir` (`admin.key`), if this user can read it.
pub fn local_admin_key(data_dir: &Path) -> Option<String> {
    let raw = std::fs::read_to_string(data_dir.join("admin.key")).ok()?;
    let key = raw.trim();
    (!key.is_empty()).then(|| key.to_string())
}
