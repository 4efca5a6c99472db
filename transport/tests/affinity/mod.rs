//! A thread's CPU affinity mask, for tests that place threads on CPUs. Included by
//! `transport/tests/cpu_hint.rs` and, by path, `rpc-core/tests/apart.rs`.

/// The calling thread's affinity mask, as CPU numbers.
pub fn mask() -> Vec<usize> {
    let set = rustix::thread::sched_getaffinity(None).expect("this thread's affinity");
    (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect()
}

/// Sets the calling thread's affinity mask to `cpus`.
pub fn set_mask(cpus: &[usize]) {
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus {
        set.set(c);
    }
    rustix::thread::sched_setaffinity(None, &set).expect("set this thread's affinity");
}
