//! The machine a sweep runs on, named in its header: the same code's figures differ with the
//! processor (on `shm`, `rpc-body` / raw was 1.1-1.6x over the sizes of two main jobs on one
//! kind of 2-core VM and 1.2-2.3x on another, `bench-results/NOTES.md`), so every recorded
//! table says where it was measured.

/// One line: the processor's model, the CPUs this process may use, their clock as the kernel
/// reports it, and whether a hypervisor is underneath, e.g.
/// `AMD EPYC, 2 CPUs at 2445 MHz, under a hypervisor`. Call it before pinning any thread:
/// the CPU count is this thread's affinity.
pub fn describe() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    describe_from(&cpuinfo, cpus)
}

fn describe_from(cpuinfo: &str, cpus: usize) -> String {
    // The first processor's fields: a VM's CPUs are all of one model.
    let field = |name: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim())
        })
    };
    let model = field("model name").unwrap_or("an unknown processor");
    let clock = field("cpu MHz")
        .and_then(|m| m.parse::<f64>().ok())
        .map(|m| format!(" at {m:.0} MHz"))
        .unwrap_or_default();
    let virt = field("flags").is_some_and(|f| f.split_whitespace().any(|x| x == "hypervisor"));
    format!(
        "{model}, {cpus} CPU{}{clock}{}",
        if cpus == 1 { "" } else { "s" },
        if virt { ", under a hypervisor" } else { "" }
    )
}
