//! The last layers applied before the agent is exec'd: capability bounding set, Landlock
//! and a seccomp filter of what sandboxes never need.

/// Capabilities root inside a sandbox keeps (all relative to its own user namespace):
/// chown, dac_override, fowner, fsetid, kill, setgid, setuid, setpcap, net_bind_service,
/// sys_chroot, audit_write, setfcap. Docker's default set without mknod and net_raw.
const KEEP_CAPS: &[u32] = &[0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31];

/// Drops every other capability from the bounding set and clears the ambient set.
pub fn drop_capabilities() -> Result<(), String> {
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
            return Err(format!(
                "drop capability {cap}: {}",
                std::io::Error::last_os_error()
            ));
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
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// clone(2) flags that would create namespaces (all in the low 32 bits of the argument).
const NS_FLAGS: u32 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP) as u32;

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
// Offsets into struct seccomp_data.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARG0_LOW: u32 = 16;

/// Where a syscall number leads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Verdict {
    Allow,
    Eperm,
    Enosys,
    /// EPERM if the flags create a namespace, else allowed.
    CloneFlags,
}

/// A jump target while the program is laid out: the next instruction, `n` instructions
/// further on, or one of the verdict blocks at the end.
#[derive(Clone, Copy)]
enum To {
    Next,
    Skip(usize),
    Verdict(Verdict),
}

/// An instruction being laid out: opcode (libc's constants are u32; all fit a u16), k.
enum Ins {
    Stmt(u32, u32),
    Jump(u32, u32, To, To),
}

/// Compares the syscall number against `keys` (sorted) as a binary search tree: about
/// six comparisons for any number, where a linear list costs one per entry. The kernel
/// also replays the filter for every syscall number when it is installed (to find the
/// ones it can allow without running it), so the tree is what keeps that step short.
fn tree(keys: &[(u32, Verdict)]) -> Vec<Ins> {
    use libc::{BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K};
    if keys.len() <= 3 {
        let mut out: Vec<Ins> = keys
            .iter()
            .map(|&(nr, v)| Ins::Jump(BPF_JMP | BPF_JEQ | BPF_K, nr, To::Verdict(v), To::Next))
            .collect();
        if let Some(Ins::Jump(_, _, _, jf)) = out.last_mut() {
            *jf = To::Verdict(Verdict::Allow);
        }
        return out;
    }
    let (left, right) = keys.split_at(keys.len() / 2);
    let pivot = right[0].0;
    let (left, right) = (tree(left), tree(right));
    let mut out = vec![Ins::Jump(
        BPF_JMP | BPF_JGE | BPF_K,
        pivot,
        To::Skip(left.len()),
        To::Next,
    )];
    out.extend(left);
    out.extend(right);
    out
}

/// The filter: EPERM for the denied list and namespace-creating clones, ENOSYS for
/// clone3 (whose flags live in memory a filter cannot read; libc falls back to clone),
/// and death for any other architecture (i386 syscalls through int 0x80).
pub fn filter() -> Result<Vec<libc::sock_filter>, String> {
    use libc::{
        BPF_ABS, BPF_ALU, BPF_AND, BPF_JEQ, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W,
    };
    let mut keys: Vec<(u32, Verdict)> = DENIED
        .iter()
        .map(|&nr| (nr as u32, Verdict::Eperm))
        .chain([
            (libc::SYS_clone as u32, Verdict::CloneFlags),
            (libc::SYS_clone3 as u32, Verdict::Enosys),
        ])
        .collect();
    keys.sort_unstable_by_key(|k| k.0);
    keys.dedup_by_key(|k| k.0);
    let mut prog = vec![
        Ins::Stmt(BPF_LD | BPF_W | BPF_ABS, DATA_ARCH),
        Ins::Jump(
            BPF_JMP | BPF_JEQ | BPF_K,
            AUDIT_ARCH_X86_64,
            To::Skip(1),
            To::Next,
        ),
        Ins::Stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        Ins::Stmt(BPF_LD | BPF_W | BPF_ABS, DATA_NR),
        // The x32 ABI reaches the same calls with bit 30 set while the filter sees the
        // x86_64 architecture: fold those numbers onto the native ones.
        Ins::Stmt(BPF_ALU | BPF_AND | BPF_K, !X32_SYSCALL_BIT),
    ];
    prog.extend(tree(&keys));
    // The clone block jumps on to the others, and BPF only jumps forward.
    let verdicts = [
        Verdict::CloneFlags,
        Verdict::Allow,
        Verdict::Eperm,
        Verdict::Enosys,
    ];
    let mut at = [0usize; 4];
    let errno = |e: i32| libc::SECCOMP_RET_ERRNO | (e as u32 & libc::SECCOMP_RET_DATA);
    for (i, v) in verdicts.iter().enumerate() {
        at[i] = prog.len();
        match v {
            Verdict::Allow => prog.push(Ins::Stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW)),
            Verdict::Eperm => prog.push(Ins::Stmt(BPF_RET | BPF_K, errno(libc::EPERM))),
            Verdict::Enosys => prog.push(Ins::Stmt(BPF_RET | BPF_K, errno(libc::ENOSYS))),
            Verdict::CloneFlags => {
                prog.push(Ins::Stmt(BPF_LD | BPF_W | BPF_ABS, DATA_ARG0_LOW));
                prog.push(Ins::Jump(
                    BPF_JMP | BPF_JSET | BPF_K,
                    NS_FLAGS,
                    To::Verdict(Verdict::Eperm),
                    To::Verdict(Verdict::Allow),
                ));
            }
        }
    }
    let target = |pc: usize, to: To| -> Result<u8, String> {
        let dest = match to {
            To::Next => pc + 1,
            To::Skip(n) => pc + 1 + n,
            To::Verdict(v) => at[verdicts.iter().position(|x| *x == v).unwrap_or(0)],
        };
        dest.checked_sub(pc + 1)
            .and_then(|d| u8::try_from(d).ok())
            .ok_or_else(|| format!("seccomp filter: jump from {pc} to {dest} out of range"))
    };
    prog.iter()
        .enumerate()
        .map(|(pc, ins)| {
            Ok(match *ins {
                Ins::Stmt(code, k) => libc::sock_filter {
                    code: code as u16,
                    jt: 0,
                    jf: 0,
                    k,
                },
                Ins::Jump(code, k, jt, jf) => libc::sock_filter {
                    code: code as u16,
                    jt: target(pc, jt)?,
                    jf: target(pc, jf)?,
                    k,
                },
            })
        })
        .collect()
}

/// Installs the filter on the calling thread (inherited by everything it execs); the
/// caller has set no_new_privs.
pub fn apply_seccomp() -> Result<(), String> {
    let insns = filter()?;
    crate::init::mark("c_bpf");
    let prog = libc::sock_fprog {
        len: u16::try_from(insns.len()).map_err(|_| "seccomp filter too long".to_string())?,
        filter: insns.as_ptr().cast_mut(),
    };
    // SAFETY: the program outlives the call, which copies it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const libc::sock_fprog,
        )
    };
    if r != 0 {
        return Err(format!(
            "seccomp install: {}",
            std::io::Error::last_os_error()
        ));
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
/// read/execute only (everything but the writable top-level directories), even if a read-only mount were ever remounted. Best effort on old kernels.
pub fn apply_landlock() -> Result<(), String> {
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
        .and_then(|r| r.restrict_self())
        .map_err(|e| format!("landlock: {e}"))?;
    if status.ruleset == RulesetStatus::NotEnforced {
        tracing::warn!("landlock is not supported by this kernel; relying on mounts alone");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the filter the way the kernel would, for the instructions it uses.
    fn run(prog: &[libc::sock_filter], arch: u32, nr: u32, arg0: u64) -> u32 {
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            pc += 1;
            match i.code as u32 {
                c if c == (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) => {
                    acc = match i.k {
                        DATA_NR => nr,
                        DATA_ARCH => arch,
                        DATA_ARG0_LOW => arg0 as u32,
                        k => panic!("load of offset {k}"),
                    }
                }
                c if c == (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) => acc &= i.k,
                c if c == (libc::BPF_RET | libc::BPF_K) => return i.k,
                c => {
                    let taken = match c & 0xf0 {
                        libc::BPF_JEQ => acc == i.k,
                        libc::BPF_JGE => acc >= i.k,
                        libc::BPF_JSET => acc & i.k != 0,
                        _ => panic!("instruction {c:#x}"),
                    };
                    pc += if taken { i.jt } else { i.jf } as usize;
                }
            }
        }
    }

    #[test]
    fn filter_verdicts() {
        let f = filter().unwrap();
        let a = AUDIT_ARCH_X86_64;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let allow = libc::SECCOMP_RET_ALLOW;
        for &nr in DENIED {
            assert_eq!(run(&f, a, nr as u32, 0), eperm, "syscall {nr}");
            assert_eq!(
                run(&f, a, nr as u32 | X32_SYSCALL_BIT, 0),
                eperm,
                "x32 {nr}"
            );
        }
        for nr in 0..600u32 {
            let listed = DENIED.contains(&(nr as i64))
                || nr == libc::SYS_clone as u32
                || nr == libc::SYS_clone3 as u32;
            if !listed {
                assert_eq!(run(&f, a, nr, u64::MAX), allow, "syscall {nr}");
            }
        }
        let clone = libc::SYS_clone as u32;
        assert_eq!(run(&f, a, clone, libc::SIGCHLD as u64), allow);
        let threads = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(run(&f, a, clone, threads), allow);
        for flag in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWCGROUP,
        ] {
            let flags = flag as u64 | libc::SIGCHLD as u64;
            assert_eq!(run(&f, a, clone, flags), eperm, "clone flag {flag:#x}");
            assert_eq!(run(&f, a, clone | X32_SYSCALL_BIT, flags), eperm);
        }
        assert_eq!(run(&f, a, libc::SYS_clone3 as u32, 0), enosys);
        assert_eq!(
            run(&f, a, libc::SYS_clone3 as u32 | X32_SYSCALL_BIT, 0),
            enosys
        );
        // i386 through int 0x80
        assert_eq!(run(&f, 0x4000_0003, 1, 0), libc::SECCOMP_RET_KILL_PROCESS);
    }

    #[test]
    fn filter_is_a_short_tree() {
        let f = filter().unwrap();
        // A linear list would be at least one comparison per entry.
        assert!(f.len() < 2 * DENIED.len() + 20, "{} instructions", f.len());
    }
}
