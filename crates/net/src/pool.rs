//! The pool of prepared network namespaces, and the one worker thread that makes them.
//!
//! Making a namespace means entering it for a moment, which only a thread of its own may
//! do: every namespace is made on the worker. It keeps `pool_size` ready and makes one at
//! once when a create finds none (a few milliseconds instead of nothing).

use super::link::{self, Netlink, Prepared};
use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TryRecvError, sync_channel};
use std::time::Duration;

/// Sandbox addresses of the subnet, handed out round-robin so that an address (and its
/// link's name) is not reused while the kernel may still be removing its previous link.
pub struct Alloc {
    base: u32,
    /// Offsets 2..last are sandboxes' (0 is the network, 1 the gateway).
    last: u32,
    next: u32,
    used: HashSet<u32>,
}

impl Alloc {
    /// The addresses of `subnet` (network address and prefix length).
    pub fn new(network: Ipv4Addr, prefix: u8) -> Self {
        let size = 1u64 << (32 - u32::from(prefix));
        Self {
            base: u32::from(network),
            last: (size - 1).min(u64::from(u32::MAX)) as u32,
            next: 2,
            used: HashSet::new(),
        }
    }

    /// A free offset.
    pub fn take(&mut self) -> Option<u32> {
        let span = self.last.saturating_sub(2);
        for _ in 0..span {
            let o = self.next;
            self.next = if self.next + 1 >= self.last {
                2
            } else {
                self.next + 1
            };
            if self.used.insert(o) {
                return Some(o);
            }
        }
        None
    }

    /// Marks the offset of `addr` used (a sandbox re-adopted after a restart).
    pub fn mark(&mut self, addr: Ipv4Addr) {
        if let Some(o) = self.offset(addr) {
            self.used.insert(o);
        }
    }

    /// Frees the offset of `addr`.
    pub fn release(&mut self, addr: Ipv4Addr) {
        if let Some(o) = self.offset(addr) {
            self.used.remove(&o);
        }
    }

    fn offset(&self, addr: Ipv4Addr) -> Option<u32> {
        let o = u32::from(addr).checked_sub(self.base)?;
        (o >= 2 && o < self.last).then_some(o)
    }

    /// The address at offset `o`.
    pub fn addr(&self, o: u32) -> Ipv4Addr {
        Ipv4Addr::from(self.base + o)
    }
}

enum Job {
    Make(SyncSender<io::Result<Prepared>>),
    OpenInside(Arc<OwnedFd>, SyncSender<io::Result<Netlink>>),
    Fill,
}

/// Prepared namespaces and the worker that makes them.
pub struct Pool {
    last_take: Arc<Mutex<Option<std::time::Instant>>>,
    tx: Mutex<Sender<Job>>,
    ready: Arc<Mutex<VecDeque<Prepared>>>,
    target: Arc<AtomicUsize>,
}

/// How the worker names and addresses links.
pub struct Naming {
    /// Prefix of the host ends' names (unique per daemon).
    pub prefix: String,
    pub gateway: Ipv4Addr,
}

impl Naming {
    /// Name of the host end of the link at offset `o`.
    pub fn host_if(&self, o: u32) -> String {
        format!("{}{o:x}", self.prefix)
    }
}

/// How long after a namespace is taken a refill waits (while a spare is left).
const REFILL_QUIET: Duration = Duration::from_millis(50);

struct Worker {
    last_take: Arc<Mutex<Option<std::time::Instant>>>,
    host: Netlink,
    host_ns: OwnedFd,
    alloc: Arc<Mutex<Alloc>>,
    naming: Naming,
    ready: Arc<Mutex<VecDeque<Prepared>>>,
    target: Arc<AtomicUsize>,
}

impl Worker {
    fn make(&mut self) -> io::Result<Prepared> {
        let mut last = None;
        for _ in 0..16 {
            let (o, addr) = {
                let mut a = self.alloc.lock();
                let o = a
                    .take()
                    .ok_or_else(|| io::Error::other("no free sandbox address in the subnet"))?;
                (o, a.addr(o))
            };
            let name = self.naming.host_if(o);
            match link::prepare(
                &mut self.host,
                &self.host_ns,
                &name,
                self.naming.gateway,
                addr,
            ) {
                Ok(p) => return Ok(p),
                Err(e) => {
                    self.alloc.lock().release(addr);
                    // A link of that name is still being removed: the next address.
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no address could be used")))
    }

    fn below_target(&self) -> bool {
        self.ready.lock().len() < self.target.load(Ordering::Acquire)
    }

    /// How long a refill should still hold back: making a namespace holds the kernel's
    /// network locks, which the sandbox just taken from the pool needs for its start.
    /// Only while there is a spare left.
    fn hold_back(&self) -> Duration {
        let spare = !self.ready.lock().is_empty();
        let since = self.last_take.lock().as_ref().map(|t| t.elapsed());
        match since {
            Some(e) if spare => REFILL_QUIET.saturating_sub(e),
            _ => Duration::ZERO,
        }
    }

    fn run(mut self, rx: Receiver<Job>) {
        let mut failures = 0u32;
        loop {
            let hold = self.hold_back();
            let job = if self.below_target() && failures < 5 && hold.is_zero() {
                match rx.try_recv() {
                    Ok(j) => Some(j),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                }
            } else {
                let wait = if failures >= 5 {
                    // Back off after repeated failures; a request still gets an answer.
                    Duration::from_secs(5)
                } else if !hold.is_zero() && self.below_target() {
                    hold
                } else {
                    Duration::from_secs(3600)
                };
                match rx.recv_timeout(wait) {
                    Ok(j) => Some(j),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        failures = failures.min(4);
                        continue;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            };
            match job {
                Some(Job::Make(reply)) => {
                    let _ = reply.send(self.make());
                }
                Some(Job::OpenInside(ns, reply)) => {
                    let _ = reply.send(link::open_inside(&ns, &self.host_ns));
                }
                Some(Job::Fill) => {}
                None => match self.make() {
                    Ok(p) => {
                        failures = 0;
                        self.ready.lock().push_back(p);
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %e, "preparing a sandbox network failed");
                    }
                },
            }
        }
    }
}

impl Pool {
    /// Starts the worker (in the host's network namespace, which it returns to after
    /// each namespace it makes). The pool fills once [`Pool::set_target`] is called.
    pub fn start(alloc: Arc<Mutex<Alloc>>, naming: Naming) -> io::Result<Pool> {
        let host = Netlink::open()?;
        let host_ns = OwnedFd::from(std::fs::File::open("/proc/self/ns/net")?);
        let ready = Arc::new(Mutex::new(VecDeque::new()));
        let target = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let last_take = Arc::new(Mutex::new(None));
        let worker = Worker {
            last_take: last_take.clone(),
            host,
            host_ns,
            alloc,
            naming,
            ready: ready.clone(),
            target: target.clone(),
        };
        std::thread::Builder::new()
            .name("sandpit-netns".into())
            .spawn(move || worker.run(rx))?;
        Ok(Pool {
            last_take,
            tx: Mutex::new(tx),
            ready,
            target,
        })
    }

    fn send(&self, job: Job) -> io::Result<()> {
        self.tx
            .lock()
            .send(job)
            .map_err(|_| io::Error::other("the network worker has stopped"))
    }

    /// How many prepared namespaces to keep.
    pub fn set_target(&self, n: usize) {
        self.target.store(n, Ordering::Release);
        let _ = self.send(Job::Fill);
    }

    /// Prepared namespaces waiting.
    pub fn ready(&self) -> usize {
        self.ready.lock().len()
    }

    /// A prepared namespace: from the pool, else made now (blocking).
    pub fn acquire(&self) -> io::Result<Prepared> {
        let pooled = self.ready.lock().pop_front();
        *self.last_take.lock() = Some(std::time::Instant::now());
        let got = match pooled {
            Some(p) => Ok(p),
            None => {
                let (reply, rx) = sync_channel(1);
                self.send(Job::Make(reply))?;
                rx.recv_timeout(Duration::from_secs(30))
                    .map_err(|_| io::Error::other("the network worker did not answer"))?
            }
        };
        let _ = self.send(Job::Fill);
        got
    }

    /// A netlink socket inside `ns` (a re-adopted sandbox's namespace).
    pub fn open_inside(&self, ns: Arc<OwnedFd>) -> io::Result<Netlink> {
        let (reply, rx) = sync_channel(1);
        self.send(Job::OpenInside(ns, reply))?;
        rx.recv_timeout(Duration::from_secs(30))
            .map_err(|_| io::Error::other("the network worker did not answer"))?
    }

    /// Host link names of the prepared namespaces.
    pub fn names(&self) -> Vec<String> {
        self.ready
            .lock()
            .iter()
            .map(|p| p.host_if.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_go_round_and_skip_the_used() {
        let mut a = Alloc::new("10.9.0.0".parse().unwrap(), 29);
        // 8 addresses: .0 network, .1 gateway, .7 broadcast; .2 to .6 for sandboxes.
        let next = |a: &mut Alloc| {
            let o = a.take().unwrap();
            a.addr(o)
        };
        let got: Vec<Ipv4Addr> = (0..5).map(|_| next(&mut a)).collect();
        assert_eq!(got[0], "10.9.0.2".parse::<Ipv4Addr>().unwrap());
        assert_eq!(got[4], "10.9.0.6".parse::<Ipv4Addr>().unwrap());
        assert!(a.take().is_none());
        a.release("10.9.0.4".parse().unwrap());
        assert_eq!(next(&mut a), "10.9.0.4".parse::<Ipv4Addr>().unwrap());
        a.release("10.9.0.1".parse().unwrap());
        assert!(a.take().is_none());
        let mut b = Alloc::new("10.9.0.0".parse().unwrap(), 29);
        b.mark("10.9.0.2".parse().unwrap());
        assert_eq!(next(&mut b), "10.9.0.3".parse::<Ipv4Addr>().unwrap());
    }
}
