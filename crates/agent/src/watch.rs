//! Directory watching for `WatchDir` (a stream) and the polling watcher calls, on inotify
//! through the `notify` crate.

use crate::fs::{FsError, FsRoot, SandboxPath, watch_target};
use connectrpc::{ConnectError, ServiceStream};
use notify::{EventKind, RecursiveMode, Watcher as _};
use parking_lot::{Mutex, MutexGuard};
use sandpit_proto::filesystem::__buffa::oneof::watch_dir_response::Event as WatchEvent;
use sandpit_proto::filesystem::*;
use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Events a polling watcher keeps before the oldest are dropped.
const MAX_PENDING_EVENTS: usize = 10_000;

/// A live inotify watch; dropping it stops watching.
struct Live {
    _watcher: notify::RecommendedWatcher,
    _dir: OwnedFd,
}

struct Polling {
    _live: Live,
    events: Arc<Mutex<Vec<FilesystemEvent>>>,
}

/// Created paths remembered per watcher to report each once (forgotten all at once beyond).
const MAX_SEEN: usize = 10_000;
/// How long after a directory's CREATE it is scanned again.
const RESCAN_DELAY: Duration = Duration::from_millis(100);
/// Entries scanned below a newly created directory, at most.
const MAX_SCANNED: usize = 1000;

/// Collects what already exists below a newly created directory (never following symlinks).
fn scan_created(dir: &std::path::Path, depth: u32, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        if out.len() >= MAX_SCANNED {
            return;
        }
        let p = e.path();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        out.push(p.clone());
        if is_dir && depth < 16 {
            scan_created(&p, depth + 1, out);
        }
    }
}

/// All polling watchers of one agent.
pub struct Watchers {
    root: Arc<FsRoot>,
    polling: Mutex<HashMap<String, Polling>>,
}

fn map_kind(kind: &EventKind) -> Option<EventType> {
    use notify::event::ModifyKind;
    Some(match kind {
        EventKind::Create(_) => EventType::EVENT_TYPE_CREATE,
        EventKind::Remove(_) => EventType::EVENT_TYPE_REMOVE,
        EventKind::Modify(ModifyKind::Name(_)) => EventType::EVENT_TYPE_RENAME,
        EventKind::Modify(ModifyKind::Metadata(_)) => EventType::EVENT_TYPE_CHMOD,
        EventKind::Modify(_) => EventType::EVENT_TYPE_WRITE,
        _ => return None,
    })
}

impl Watchers {
    /// Watchers confined to `root`.
    pub fn new(root: Arc<FsRoot>) -> Self {
        Self {
            root,
            polling: Mutex::new(HashMap::new()),
        }
    }

    /// Starts watching; every event is handed to `sink` already converted.
    fn start(
        &self,
        p: &SandboxPath,
        recursive: bool,
        include_entry: bool,
        sink: impl Fn(FilesystemEvent) + Send + Sync + 'static,
    ) -> Result<Live, ConnectError> {
        let (dir, watch_path) = watch_target(&self.root, p)?;
        let root = self.root.clone();
        let base: PathBuf = watch_path.clone();
        let abs = p.abs.clone();
        // Paths whose CREATE was reported, so that a rescan reports only what was missed.
        let seen: Arc<Mutex<HashSet<PathBuf>>> = Arc::default();
        let emit = {
            let seen = seen.clone();
            Arc::new(move |path: PathBuf, kind: EventType| {
                {
                    let mut seen = seen.lock();
                    match kind {
                        EventType::EVENT_TYPE_CREATE => {
                            if seen.len() >= MAX_SEEN {
                                seen.clear();
                            }
                            if !seen.insert(path.clone()) {
                                return;
                            }
                        }
                        EventType::EVENT_TYPE_REMOVE | EventType::EVENT_TYPE_RENAME => {
                            seen.remove(&path);
                        }
                        _ => {}
                    }
                }
                let Ok(rel) = path.strip_prefix(&base) else {
                    return;
                };
                let name = rel.to_string_lossy().into_owned();
                let mut fe = FilesystemEvent {
                    name: name.clone(),
                    r#type: kind.into(),
                    ..Default::default()
                };
                if include_entry {
                    let full = if abs == "/" {
                        format!("/{name}")
                    } else {
                        format!("{abs}/{name}")
                    };
                    if let Ok(info) = root.entry_info(&SandboxPath { abs: full }) {
                        fe.entry = info.into();
                    }
                }
                sink(fe);
            })
        };
        // notify adds the watch of a new directory only after handing us its CREATE, so
        // what is made inside it in between is reported by a scan now and another a
        // moment later (after the watch surely exists), by one worker per watcher.
        let (rescan_tx, rescan_rx) = std::sync::mpsc::channel::<PathBuf>();
        if recursive {
            let emit = emit.clone();
            std::thread::Builder::new()
                .name("watch-rescan".into())
                .spawn(move || {
                    while let Ok(first) = rescan_rx.recv() {
                        std::thread::sleep(RESCAN_DELAY);
                        let mut dirs = vec![first];
                        dirs.extend(rescan_rx.try_iter());
                        dirs.sort();
                        dirs.dedup();
                        let mut paths = Vec::new();
                        for d in &dirs {
                            scan_created(d, 0, &mut paths);
                        }
                        for p in paths {
                            emit(p, EventType::EVENT_TYPE_CREATE);
                        }
                    }
                })
                .map_err(|e| ConnectError::internal(format!("watch: {e}")))?;
        }
        let rescan_tx = Mutex::new(rescan_tx);
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(ev) = res else { return };
            let Some(kind) = map_kind(&ev.kind) else {
                return;
            };
            let mut paths = ev.paths;
            if recursive && kind == EventType::EVENT_TYPE_CREATE {
                let created: Vec<PathBuf> = paths
                    .iter()
                    .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
                    .cloned()
                    .collect();
                for dir in created {
                    scan_created(&dir, 0, &mut paths);
                    let _ = rescan_tx.lock().send(dir);
                }
            }
            for path in paths {
                emit(path, kind);
            }
        })
        .map_err(|e| ConnectError::internal(format!("watch: {e}")))?;
        let mode = if recursive {
            RecursiveMode::Recursive
        } else {
            RecursiveMode::NonRecursive
        };
        watcher.watch(&watch_path, mode).map_err(|e| {
            ConnectError::from(FsError::Io(
                p.abs.clone(),
                std::io::Error::other(e.to_string()),
            ))
        })?;
        Ok(Live {
            _watcher: watcher,
            _dir: dir,
        })
    }

    /// A `WatchDir` stream: a start event, then filesystem events and keepalives.
    pub fn stream(
        &self,
        p: SandboxPath,
        recursive: bool,
        include_entry: bool,
        keepalive: Duration,
    ) -> Result<ServiceStream<WatchDirResponse>, ConnectError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let live = self.start(&p, recursive, include_entry, move |fe| {
            let _ = tx.send(fe);
        })?;
        let first = WatchDirResponse {
            event: Some(WatchEvent::Start(Box::default())),
            ..Default::default()
        };
        let state = (Some(first), rx, live);
        let s = futures::stream::unfold(state, move |(first, mut rx, live)| async move {
            if let Some(f) = first {
                return Some((Ok(f), (None, rx, live)));
            }
            let ev = tokio::select! {
                ev = rx.recv() => match ev {
                    Some(fe) => WatchEvent::Filesystem(Box::new(fe)),
                    None => return None,
                },
                _ = tokio::time::sleep(keepalive) => WatchEvent::Keepalive(Box::default()),
            };
            Some((
                Ok(WatchDirResponse {
                    event: Some(ev),
                    ..Default::default()
                }),
                (None, rx, live),
            ))
        });
        Ok(Box::pin(s))
    }

    /// Creates a polling watcher and returns its id.
    pub fn create(
        &self,
        p: SandboxPath,
        recursive: bool,
        include_entry: bool,
    ) -> Result<String, ConnectError> {
        let events: Arc<Mutex<Vec<FilesystemEvent>>> = Arc::default();
        let sink_events = events.clone();
        let live = self.start(&p, recursive, include_entry, move |fe| {
            let mut v = sink_events.lock();
            if v.len() >= MAX_PENDING_EVENTS {
                v.remove(0);
            }
            v.push(fe);
        })?;
        let id = uuid::Uuid::new_v4().to_string();
        self.lock().insert(
            id.clone(),
            Polling {
                _live: live,
                events,
            },
        );
        Ok(id)
    }

    /// Returns and clears the events a polling watcher has gathered.
    pub fn drain(&self, id: &str) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let map = self.lock();
        let w = map
            .get(id)
            .ok_or_else(|| ConnectError::not_found(format!("watcher {id} not found")))?;
        Ok(std::mem::take(&mut *w.events.lock()))
    }

    /// Stops a polling watcher.
    pub fn remove(&self, id: &str) -> Result<(), ConnectError> {
        self.lock()
            .remove(id)
            .map(|_| ())
            .ok_or_else(|| ConnectError::not_found(format!("watcher {id} not found")))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Polling>> {
        self.polling.lock()
    }
}
