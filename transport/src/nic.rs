//! The software NIC's parts that serve a whole device, shared by the `tcp` and `shm` providers.

pub(crate) mod progress;
