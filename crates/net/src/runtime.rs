//! The container runtime with a network: wraps it so that every start (create, pool
//! refill, wake from hibernation, fork, restore) joins a prepared namespace, and every
//! teardown lets go of it. The rest of the daemon never sees the difference.

use super::Net;
use sandpit_runtime::{
    Capabilities, NetAttachment, Runtime, RuntimeError, SandboxHandle, SandboxNet, SandboxSpec,
    Stats, UpperView,
};
use std::sync::Arc;

/// A runtime whose sandboxes get a network namespace with a link to the host.
pub struct NetRuntime {
    inner: Arc<dyn Runtime>,
    net: Arc<Net>,
}

impl NetRuntime {
    /// Wraps `inner` (the container runtime).
    pub fn new(inner: Arc<dyn Runtime>, net: Arc<Net>) -> Self {
        Self { inner, net }
    }
}

impl Runtime for NetRuntime {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        let prepared = self
            .net
            .acquire()
            .map_err(|e| RuntimeError::network("prepare the sandbox's network", e))?;
        let (address, host_if) = (prepared.address, prepared.host_if.clone());
        let mut h = match self.inner.create(spec) {
            Ok(h) => h,
            Err(e) => {
                self.net.discard(prepared);
                return Err(e);
            }
        };
        self.net.attach(&spec.id, prepared);
        h.net = Some(NetAttachment { address, host_if });
        Ok(h)
    }

    fn start(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        let netns = self.net.netns_of(&h.id).ok_or_else(|| {
            RuntimeError::Setup(format!("sandbox {} has no network prepared", h.id))
        })?;
        self.net
            .apply_route(&h.id)
            .map_err(|e| RuntimeError::network("route the sandbox's traffic", e))?;
        let mut spec = spec.clone();
        spec.net = Some(SandboxNet {
            netns,
            resolv_conf: self.net.resolv_conf(),
        });
        self.inner.start(&spec, h)
    }

    fn kill(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.inner.kill(h)
    }

    fn freeze(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.inner.freeze(h)
    }

    fn thaw(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.inner.thaw(h)
    }

    fn stats(&self, h: &SandboxHandle) -> Result<Stats, RuntimeError> {
        self.inner.stats(h)
    }

    fn liveness(&self, h: &SandboxHandle) -> sandpit_runtime::Liveness {
        self.inner.liveness(h)
    }

    fn destroy(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        let r = self.inner.destroy(h);
        if r.is_ok() {
            self.net.detach(&h.id);
        }
        r
    }

    fn remove_orphans(&self, keep: &[String]) -> Result<Vec<String>, RuntimeError> {
        let removed = self.inner.remove_orphans(keep)?;
        self.net.sweep_links();
        Ok(removed)
    }

    fn adopt(&self, h: &SandboxHandle) {
        self.inner.adopt(h);
        if let Some(n) = &h.net {
            self.net.adopt(&h.id, n, h.pid, h.pid_start);
        }
    }

    fn begin_stop(&self, h: &SandboxHandle) {
        self.inner.begin_stop(h)
    }

    fn open_upper(&self, h: &SandboxHandle) -> Result<UpperView, RuntimeError> {
        self.inner.open_upper(h)
    }

    fn release(&self) {
        self.inner.release();
        self.net.release();
    }
}
