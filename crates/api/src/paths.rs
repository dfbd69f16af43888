//! Lexical checks of sandbox paths, shared by the daemon (to refuse early) and the agent
//! (which additionally resolves them race-free inside the sandbox root).

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    /// Empty, too long, or containing a NUL byte.
    Invalid(&'static str),
    /// A `..` that climbs above `/`.
    Escape,
}

/// Longest path accepted, in bytes.
pub const MAX_PATH: usize = 4096;

/// Normalises `path` to an absolute path without `.` or `..`; relative paths are taken
/// from `home`. A `..` above `/` is refused rather than clamped, so a caller never gets a
/// different file than the one it named.
pub fn normalize(path: &str, home: &str) -> Result<String, PathError> {
    if path.is_empty() {
        return Err(PathError::Invalid("empty path"));
    }
    if path.contains('\0') {
        return Err(PathError::Invalid("path contains a NUL byte"));
    }
    if path.len() > MAX_PATH {
        return Err(PathError::Invalid("path longer than 4096 bytes"));
    }
    let mut parts: Vec<&str> = Vec::new();
    let full = if path.starts_with('/') {
        None
    } else {
        Some(home)
    };
    for comp in full
        .into_iter()
        .chain(std::iter::once(path))
        .flat_map(|p| p.split('/'))
    {
        match comp {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(PathError::Escape);
                }
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_and_refuses() {
        assert_eq!(normalize("/a/./b/../c//", "/h").unwrap(), "/a/c");
        assert_eq!(normalize("x/y", "/home/user").unwrap(), "/home/user/x/y");
        assert_eq!(normalize("/", "/h").unwrap(), "/");
        assert_eq!(normalize("../../..", "/home/user"), Err(PathError::Escape));
        assert_eq!(normalize("/..", "/"), Err(PathError::Escape));
        assert!(matches!(normalize("", "/"), Err(PathError::Invalid(_))));
        assert!(matches!(normalize("a\0b", "/"), Err(PathError::Invalid(_))));
        assert!(matches!(
            normalize(&"x".repeat(5000), "/"),
            Err(PathError::Invalid(_))
        ));
    }
}
