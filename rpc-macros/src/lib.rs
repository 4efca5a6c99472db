//! The `#[service]` attribute of rdma-rpc: a trait of `async fn`s becomes a typed client, a
//! server dispatcher and stable method ids. Use it through the facade crate, `rdma_rpc::service`,
//! whose documentation shows a whole service.
//!
//! The macro parses first, collects every error with its span, and only then generates
//! (`model`, then `expand`); nothing is generated for a trait with errors.

mod expand;
mod ids;
mod model;

use proc_macro::TokenStream;

/// Turns a trait of `async fn`s into a service: see the `rdma_rpc` crate's documentation.
///
/// Generates, next to the trait (whose methods become `fn ... -> impl Future + Send`):
/// `<Trait>Client` (the same methods, async, returning `Result<T, RpcError>`),
/// `<Trait>Server<S>` (dispatch for any `S: Trait`), and one stable method id per method
/// (FNV-1a of `Trait.method`, or `#[rpc(id = N)]`), listed in `<Trait>Client::METHOD_IDS`.
///
/// Options: `#[service(crate = "path")]` names the facade crate when it is re-exported under a
/// path the macro cannot find from `Cargo.toml`.
#[proc_macro_attribute]
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    match model::Service::parse(attr.into(), item.into()) {
        Ok(service) => expand::expand(&service).into(),
        Err(errors) => errors.to_compile_error().into(),
    }
}
