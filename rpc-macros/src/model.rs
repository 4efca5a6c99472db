//! Parsing and checking: a `#[service]` trait becomes a [`Service`], or every error found in it,
//! each with its span.

use proc_macro2::{Span, TokenStream};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Attribute, FnArg, Ident, ItemTrait, Pat, ReturnType, TraitItem, TraitItemFn, Type};

use crate::ids;

/// Names the generated client defines itself; a method may not take one of them.
pub(crate) const CLIENT_ITEMS: &[&str] = &["new", "connect", "with_options", "options", "inner"];

/// A checked service trait.
pub(crate) struct Service {
    /// The trait as written, minus the methods (re-emitted from [`Method`]).
    pub(crate) item: ItemTrait,
    /// The path of the facade crate in generated code.
    pub(crate) krate: syn::Path,
    pub(crate) methods: Vec<Method>,
}

/// One `async fn` of the trait.
pub(crate) struct Method {
    /// Attributes to keep (docs, lints), without `#[rpc(...)]`.
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) name: Ident,
    pub(crate) id: u32,
    pub(crate) args: Vec<Arg>,
    /// The declared return type; `()` when none.
    pub(crate) ret: Type,
    /// The return type is the bulk byte type: the response is its raw bytes.
    pub(crate) ret_bulk: bool,
}

/// One argument after `&self`.
pub(crate) struct Arg {
    pub(crate) name: Ident,
    pub(crate) ty: Type,
    /// The bulk byte type: sent raw, outside the serialized arguments.
    pub(crate) bulk: bool,
}

/// Every error found, combined.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, span: Span, msg: impl std::fmt::Display) {
        let e = syn::Error::new(span, msg);
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    /// An error underlining all of `tokens` (not only their first token).
    fn push_at(&mut self, tokens: impl quote::ToTokens, msg: impl std::fmt::Display) {
        self.push_err(syn::Error::new_spanned(tokens, msg));
    }

    fn push_err(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    fn count(&self) -> usize {
        self.0.as_ref().map_or(0, |e| e.clone().into_iter().count())
    }

    /// The errors as `compile_error!` invocations.
    pub(crate) fn to_compile_error(&self) -> TokenStream {
        self.0.as_ref().map(syn::Error::to_compile_error).unwrap_or_default()
    }
}

impl Service {
    /// Parses the attribute's arguments and the trait; collects every problem before failing.
    pub(crate) fn parse(attr: TokenStream, item: TokenStream) -> Result<Service, Errors> {
        let mut errors = Errors::default();
        let krate = match parse_attr(attr) {
            Ok(k) => k,
            Err(e) => {
                errors.push_err(e);
                None
            }
        };
        let mut item: ItemTrait = match syn::parse2(item) {
            Ok(t) => t,
            Err(e) => {
                let mut errors = Errors::default();
                errors.push(e.span(), "#[service] goes on a trait of `async fn` methods");
                return Err(errors);
            }
        };
        if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
            errors.push_at(
                &item.generics,
                "a #[service] trait cannot be generic: client and server must agree on concrete types",
            );
        }
        if let Some(u) = &item.unsafety {
            errors.push(u.span(), "a #[service] trait cannot be `unsafe`");
        }
        let service_name = item.ident.to_string();
        let mut methods: Vec<Method> = Vec::new();
        for ti in std::mem::take(&mut item.items) {
            match ti {
                TraitItem::Fn(f) => {
                    if let Some(m) = method(&service_name, f, &mut errors) {
                        if let Some(prev) = methods.iter().find(|p| p.id == m.id) {
                            errors.push(
                                m.name.span(),
                                format!(
                                    "method `{}` has the same id {} as `{}`: give one of them another `#[rpc(id = ...)]`",
                                    m.name, m.id, prev.name
                                ),
                            );
                        }
                        methods.push(m);
                    }
                }
                other => errors.push_at(
                    &other,
                    "a #[service] trait holds only `async fn` methods (no consts, types or macros)",
                ),
            }
        }
        match errors.0 {
            Some(_) => Err(errors),
            None => Ok(Service {
                item,
                krate: krate.unwrap_or_else(default_crate_path),
                methods,
            }),
        }
    }
}

/// `crate = "path"` or `crate = path`.
fn parse_attr(attr: TokenStream) -> syn::Result<Option<syn::Path>> {
    let mut krate = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("crate") {
            let value = meta.value()?;
            krate = Some(if value.peek(syn::LitStr) {
                value.parse::<syn::LitStr>()?.parse::<syn::Path>()?
            } else {
                value.parse::<syn::Path>()?
            });
            Ok(())
        } else {
            Err(meta.error("unknown #[service] option: the only one is `crate = \"path::to::rdma_rpc\"`"))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(krate)
}

/// `::rdma_rpc`, or the name the caller's `Cargo.toml` gives the `rdma-rpc` package.
fn default_crate_path() -> syn::Path {
    use proc_macro_crate::{crate_name, FoundCrate};
    let name = match crate_name("rdma-rpc") {
        Ok(FoundCrate::Name(n)) => n,
        // `Itself`: the package's own tests, examples and doc tests, which see it as `rdma_rpc`.
        Ok(FoundCrate::Itself) | Err(_) => "rdma_rpc".to_owned(),
    };
    let ident = Ident::new(&name, Span::call_site());
    syn::parse_quote!(::#ident)
}

/// Checks one method; pushes its errors and returns it when it has none.
fn method(service: &str, f: TraitItemFn, errors: &mut Errors) -> Option<Method> {
    let before = errors.count();
    let sig = &f.sig;
    let name = sig.ident.clone();
    if sig.asyncness.is_none() {
        errors.push(
            sig.fn_token.span(),
            format!("`{name}` must be an `async fn`: a #[service] method is a remote call that the client awaits"),
        );
    }
    if let Some(c) = &sig.constness {
        errors.push(c.span(), format!("`{name}` cannot be `const`"));
    }
    if let Some(u) = &sig.unsafety {
        errors.push(u.span(), format!("`{name}` cannot be `unsafe`"));
    }
    if let Some(a) = &sig.abi {
        errors.push(a.span(), format!("`{name}` cannot name an ABI"));
    }
    if let Some(v) = &sig.variadic {
        errors.push(v.span(), format!("`{name}` cannot be variadic"));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push_at(
            &sig.generics,
            format!("`{name}` cannot be generic: each argument of a remote call needs one concrete type"),
        );
    }
    if let Some(body) = &f.default {
        errors.push_at(
            body,
            format!("`{name}` cannot have a default body in a #[service] trait: write it in the `impl`"),
        );
    }
    if CLIENT_ITEMS.contains(&name.to_string().as_str()) {
        errors.push(
            name.span(),
            format!(
                "a method named `{name}` would clash with the generated client's own `{name}`: rename the method \
                 (the client reserves {})",
                CLIENT_ITEMS
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    let id = match rpc_id(&f.attrs) {
        Ok(Some(id)) => id,
        Ok(None) => ids::derived(service, &name.to_string()),
        Err(e) => {
            errors.push_err(e);
            0
        }
    };

    let mut inputs = sig.inputs.iter();
    match inputs.next() {
        Some(FnArg::Receiver(r)) if r.reference.is_some() && r.mutability.is_none() && r.colon_token.is_none() => {}
        Some(FnArg::Receiver(r)) if r.reference.is_none() && r.colon_token.is_none() => errors.push_at(
            r,
            format!("`{name}` takes `self` by value: a #[service] method takes `&self`, the server shares one service value between calls"),
        ),
        Some(FnArg::Receiver(r)) if r.mutability.is_some() && r.reference.is_some() => errors.push_at(
            r,
            format!("`{name}` takes `&mut self`: a #[service] method takes `&self`, calls run concurrently (use a Mutex or atomics inside)"),
        ),
        Some(FnArg::Receiver(r)) => errors.push_at(
            r,
            format!("`{name}` takes `{}`: a #[service] method takes plain `&self`", quote::quote!(#r)),
        ),
        _ => errors.push(
            name.span(),
            format!("`{name}` has no `&self`: a #[service] method takes `&self` first"),
        ),
    }

    let mut args = Vec::new();
    for input in sig.inputs.iter().skip(1) {
        let FnArg::Typed(pt) = input else {
            errors.push_at(input, "`self` can only come first");
            continue;
        };
        let arg_name = match &*pt.pat {
            Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => pi.ident.clone(),
            other => {
                errors.push_at(
                    other,
                    "patterns are not allowed as argument names in a #[service] trait: name the argument \
                     (`point: Point`) and destructure it in the `impl`",
                );
                continue;
            }
        };
        check_type(&pt.ty, &format!("argument `{arg_name}`"), errors);
        let bulk = is_bulk(&pt.ty);
        if bulk && args.iter().any(|a: &Arg| a.bulk) {
            errors.push_at(
                &pt.ty,
                format!(
                    "`{name}` has a second bulk argument: only one argument travels raw; put the others in a struct"
                ),
            );
        }
        args.push(Arg {
            name: arg_name,
            ty: (*pt.ty).clone(),
            bulk,
        });
    }
    let ret: Type = match &sig.output {
        ReturnType::Default => syn::parse_quote!(()),
        ReturnType::Type(_, t) => {
            check_type(t, "the return type", errors);
            (**t).clone()
        }
    };
    if errors.count() != before {
        return None;
    }
    Some(Method {
        attrs: f.attrs.into_iter().filter(|a| !a.path().is_ident("rpc")).collect(),
        name,
        id,
        ret_bulk: is_bulk(&ret),
        ret,
        args,
    })
}

/// `#[rpc(id = N)]`, if present.
fn rpc_id(attrs: &[Attribute]) -> syn::Result<Option<u32>> {
    let mut id = None;
    for a in attrs.iter().filter(|a| a.path().is_ident("rpc")) {
        a.parse_nested_meta(|meta| {
            if meta.path.is_ident("id") {
                id = Some(meta.value()?.parse::<syn::LitInt>()?.base10_parse::<u32>()?);
                Ok(())
            } else {
                Err(meta.error("unknown #[rpc] option: the only one is `id = <u32>`"))
            }
        })?;
    }
    Ok(id)
}

/// Types that cannot travel: `impl Trait` and borrowed data.
fn check_type(ty: &Type, what: &str, errors: &mut Errors) {
    struct Finder<'a> {
        what: &'a str,
        errors: &'a mut Errors,
    }
    impl<'ast> Visit<'ast> for Finder<'_> {
        fn visit_type_impl_trait(&mut self, t: &'ast syn::TypeImplTrait) {
            self.errors.push_at(
                t,
                format!(
                    "{} uses `impl Trait`, which cannot travel over the wire: use a concrete type that implements \
                     Serialize and Deserialize",
                    self.what
                ),
            );
        }
        fn visit_type_reference(&mut self, t: &'ast syn::TypeReference) {
            self.errors.push_at(
                t,
                format!(
                    "{} borrows (`&`): a remote call sends and receives owned values; use an owned type \
                     (String, Vec<T>, ...)",
                    self.what
                ),
            );
        }
    }
    Finder { what, errors }.visit_type(ty);
}

/// The bulk byte type, recognized by name: `Bulk` or any path ending in `::Bulk`.
fn is_bulk(ty: &Type) -> bool {
    match ty {
        Type::Path(p) if p.qself.is_none() => p
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident == "Bulk" && s.arguments.is_none()),
        Type::Group(g) => is_bulk(&g.elem),
        Type::Paren(p) => is_bulk(&p.elem),
        _ => false,
    }
}
