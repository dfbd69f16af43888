//! Sandbox networking: per-sandbox network namespaces, the egress policy, the host-side DNS
//! resolver and egress proxy, and the audit of outbound connections.

pub mod intercept;
