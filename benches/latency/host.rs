//! The machine a sweep runs on, named in its header: the same code's figures, and its ratios,
//! differ with the processor, so every recorded table says where it was measured, and how much of the run's CPU time the hypervisor took
//! (steal): on a shared host a row measured while the guest's CPUs wait for theirs has
//! medians several times its neighbours'.

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
    // Generic model names ("Intel(R) Xeon(R) Processor") hide which processor it is.
    let id = match (field("cpu family"), field("model")) {
        (Some(f), Some(m)) => format!(" (family {f}, model {m})"),
        _ => String::new(),
    };
    let clock = field("cpu MHz")
        .and_then(|m| m.parse::<f64>().ok())
        .map(|m| format!(" at {m:.0} MHz"))
        .unwrap_or_default();
    let virt = field("flags").is_some_and(|f| f.split_whitespace().any(|x| x == "hypervisor"));
    format!(
        "{model}{id}, {cpus} CPU{}{clock}{}",
        if cpus == 1 { "" } else { "s" },
        if virt { ", under a hypervisor" } else { "" }
    )
}

/// The guest's CPU time in ticks of `/proc/stat`'s first line (all CPUs): the time the
/// hypervisor gave the CPUs to others while this guest wanted them (steal), and the total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ticks {
    pub steal: u64,
    pub total: u64,
}

impl Ticks {
    /// The ticks since `before`, an earlier reading.
    pub fn since(self, before: Ticks) -> Ticks {
        Ticks {
            steal: self.steal.saturating_sub(before.steal),
            total: self.total.saturating_sub(before.total),
        }
    }

    /// Both spans together.
    pub fn plus(self, other: Ticks) -> Ticks {
        Ticks {
            steal: self.steal + other.steal,
            total: self.total + other.total,
        }
    }

    /// Steal as a percentage of the total, when the span holds enough ticks to say (ten: a
    /// tick is 10 ms of one CPU, so 50 ms of a 2-CPU guest).
    pub fn steal_pct(self) -> Option<f64> {
        (self.total >= 10).then(|| 100.0 * self.steal as f64 / self.total as f64)
    }
}

/// The guest's CPU ticks now; `None` where `/proc/stat` is missing or has no steal field.
pub fn ticks() -> Option<Ticks> {
    ticks_from(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// `cpu  user nice system idle iowait irq softirq steal ...`: the first eight fields are the
/// whole (guest time is counted in user already).
fn ticks_from(stat: &str) -> Option<Ticks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|x| x.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()?;
    let steal = *v.get(7)?;
    Some(Ticks {
        steal,
        total: v.iter().sum(),
    })
}
