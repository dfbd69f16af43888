//! The last layers applied before the agent is exec'd: capability bounding set, Landlock
//! and a seccomp filter of what sandboxes never need.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// Why one of the last confinement steps before the agent's exec failed.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// `PR_CAPBSET_DROP` refused a capability.
    #[error("drop capability {cap}: {source}")]
    DropCapability {
        cap: u32,
        #[source]
        source: std::io::Error,
    },
    /// seccompiler does not know this machine's architecture.
    #[error("seccomp arch: {source}")]
    SeccompArch {
        #[source]
        source: seccompiler::BackendError,
    },
    /// Building or compiling the seccomp filter failed (`step` says which part).
    #[error("seccomp {step}: {source}")]
    SeccompBuild {
        step: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    /// The kernel refused the seccomp filter.
    #[error("seccomp install: {source}")]
    SeccompInstall {
        #[source]
        source: seccompiler::Error,
    },
    /// The Landlock ruleset could not be built or applied.
    #[error("landlock: {source}")]
    Landlock {
        #[source]
        source: landlock::RulesetError,
    },
}

fn build(step: &'static str) -> impl Fn(seccompiler::BackendError) -> SecurityError {
    move |source| SecurityError::SeccompBuild { step, source }
}

/// Capabilities root inside a sandbox keeps (all relative to its own user namespace):
/// chown, dac_override, fowner, fsetid, kill, setgid, setuid, setpcap, net_bind_service,
/// sys_chroot, audit_write, setfcap. Docker's default set without mknod and net_raw.
const KEEP_CAPS: &[u32] = &[0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31];

/// Drops every other capability from the bounding set and clears the ambient set.
pub fn drop_capabilities() -> Result<(), SecurityError> {
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    for cap in 0..=last {
        if KEEP_CAPS.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(SecurityError::DropCapability {
                cap,
                source: std::io::Error::last_os_error(),
            });
        }
    }
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    Ok(())
}

/// Syscalls refused with EPERM: kernel and host administration, module and kernel-image
/// loading, new namespaces and mounts, bpf, keyrings, perf, userfaultfd, io_uring.
const DENIED: &[i64] = &[
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_fsconfig,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_quotactl,
    libc::SYS_lookup_dcookie,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_syslog,
    libc::SYS_uselib,
    libc::SYS_personality,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_vhangup,
    libc::SYS_kcmp,
    libc::SYS_process_vm_writev,
    libc::SYS_fanotify_init,
    libc::SYS_nfsservctl,
];

/// Marks x32-ABI syscall numbers on x86_64.
const X32_SYSCALL_BIT: i64 = 0x4000_0000;

/// clone(2) flags that would create namespaces.
const NS_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn arch() -> Result<TargetArch, SecurityError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|source| SecurityError::SeccompArch { source })
}

/// The compiled filters: EPERM for the denied list and namespace-creating clones, ENOSYS
/// for clone3 (whose flags live in memory a filter cannot read; libc falls back to clone).
pub fn filters() -> Result<Vec<BpfProgram>, SecurityError> {
    // The x32 ABI reaches the same calls with bit 30 set in the number while the filter sees
    // the x86_64 architecture; deny those numbers too (harmless where x32 is compiled out).
    let x32 = DENIED.iter().map(|s| s | X32_SYSCALL_BIT);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED
        .iter()
        .copied()
        .chain(x32)
        .map(|s| (s, vec![]))
        .collect();
    let mut clone_rules = Vec::new();
    for flag in NS_FLAGS {
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(*flag),
            *flag,
        )
        .map_err(build("rule"))?;
        clone_rules.push(SeccompRule::new(vec![cond]).map_err(build("rule"))?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )
    .map_err(build("filter"))?;
    let clone3: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, vec![])].into_iter().collect();
    let nosys = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch()?,
    )
    .map_err(build("filter"))?;
    let mut out = Vec::new();
    for f in [deny, nosys] {
        out.push(BpfProgram::try_from(f).map_err(build("compile"))?);
    }
    Ok(out)
}

/// Installs the filters on the calling thread (inherited by everything it execs).
pub fn apply_seccomp() -> Result<(), SecurityError> {
    let filters = filters()?;
    crate::init::mark("c_bpf");
    for f in filters {
        seccompiler::apply_filter(&f).map_err(|source| SecurityError::SeccompInstall { source })?;
    }
    Ok(())
}

/// Top-level directories of a `host` sandbox that stay writable.
const LANDLOCK_WRITABLE: &[&str] = &[
    "/home",
    "/tmp",
    "/workspace",
    "/root",
    "/etc",
    "/var",
    "/run",
    "/opt",
    "/mnt",
    "/dev",
    "/proc",
];

/// Confines the filesystem with Landlock where the kernel has it: the host's files are
/// read/execute only (everything but the writable top-level directories and the mount
/// points of writable volumes, `volumes`), even if a read-only mount were ever remounted.
/// Best effort on old kernels.
pub fn apply_landlock(volumes: &[&str]) -> Result<(), SecurityError> {
    use landlock::{
        ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus,
        path_beneath_rules,
    };
    let abi = ABI::V5;
    let all = AccessFs::from_all(abi);
    let read = AccessFs::from_read(abi);
    let status = Ruleset::default()
        .handle_access(all)
        .and_then(|r| r.create())
        .and_then(|r| r.add_rules(path_beneath_rules(["/"], read)))
        .and_then(|r| r.add_rules(path_beneath_rules(LANDLOCK_WRITABLE, all)))
        .and_then(|r| r.add_rules(path_beneath_rules(volumes, all)))
        .and_then(|r| r.restrict_self())
        .map_err(|source| SecurityError::Landlock { source })?;
    if status.ruleset == RulesetStatus::NotEnforced {
        tracing::warn!("landlock is not supported by this kernel; relying on mounts alone");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile_for_this_arch() {
        let f = super::filters().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f[0].len() > 2 * super::DENIED.len());
    }

    #[test]
    fn security_errors_name_the_step_and_keep_the_cause() {
        use super::SecurityError;
        use std::error::Error as _;
        let e = SecurityError::DropCapability {
            cap: 21,
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        };
        assert_eq!(
            e.to_string(),
            format!(
                "drop capability 21: {}",
                std::io::Error::from_raw_os_error(libc::EPERM)
            )
        );
        let io = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(io.and_then(|e| e.raw_os_error()), Some(libc::EPERM));

        let e = SecurityError::SeccompBuild {
            step: "rule",
            source: seccompiler::BackendError::EmptyRule,
        };
        assert_eq!(
            e.to_string(),
            format!("seccomp rule: {}", seccompiler::BackendError::EmptyRule)
        );
        assert!(e.source().is_some());
        let arch = seccompiler::TargetArch::try_from("vax").unwrap_err();
        let e = SecurityError::SeccompArch { source: arch };
        assert!(e.to_string().starts_with("seccomp arch: "));
        assert!(e.source().is_some());
    }
}
