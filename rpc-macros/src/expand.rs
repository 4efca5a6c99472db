//! Code generation from a checked [`Service`]: the trait with `Send` futures, the client, the
//! server dispatcher. Generated code names only absolute paths (`::core`, `::std`, the facade
//! crate), so it compiles under `#![no_implicit_prelude]`; its own locals are `mixed_site`, so
//! argument names never clash with them.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Ident;

use crate::model::{Method, Service};

/// The whole expansion.
pub(crate) fn expand(s: &Service) -> TokenStream {
    let tr = trait_def(s);
    let client = client(s);
    let server = server(s);
    quote! { #tr #client #server }
}

fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

fn qualname(s: &Service, m: &Method) -> String {
    format!("{}.{}", s.item.ident, m.name)
}

fn trait_def(s: &Service) -> TokenStream {
    let item = &s.item;
    let (attrs, vis, ident, colon, supertraits) = (
        &item.attrs,
        &item.vis,
        &item.ident,
        &item.colon_token,
        &item.supertraits,
    );
    let methods = s.methods.iter().map(|m| {
        let (attrs, name, ret) = (&m.attrs, &m.name, &m.ret);
        let args = m.args.iter().map(|a| {
            let (n, t) = (&a.name, &a.ty);
            quote!(#n: #t)
        });
        quote! {
            #(#attrs)*
            fn #name(&self, #(#args),*) -> impl ::core::future::Future<Output = #ret> + ::core::marker::Send;
        }
    });
    quote! {
        #(#attrs)*
        #vis trait #ident #colon #supertraits {
            #(#methods)*
        }
    }
}

fn client(s: &Service) -> TokenStream {
    let krate = &s.krate;
    let vis = &s.item.vis;
    let tr = &s.item.ident;
    let client = format_ident!("{}Client", tr);
    let doc = format!(
        "The client of [`{tr}`]: the trait's methods as remote calls, each returning \
         `Result<T, RpcError>`. Cheap to clone; clones share one connection."
    );
    let (inner, options) = (local("inner"), local("options"));
    let (payload, response) = (local("payload"), local("response"));
    let out = local("out");
    let ids = s.methods.iter().map(|m| {
        let (n, id) = (m.name.to_string(), m.id);
        quote!((#n, #id))
    });
    let methods = s.methods.iter().map(|m| {
        let (attrs, name, ret, id) = (&m.attrs, &m.name, &m.ret, m.id);
        let q = qualname(s, m);
        let params = m.args.iter().map(|a| {
            let (n, t) = (&a.name, &a.ty);
            quote!(#n: #t)
        });
        // Each argument pushed at its type's span: a type without serde's traits is reported
        // at the argument (and a result's at the return type), not at the macro.
        let pushes = m.args.iter().filter(|a| !a.bulk).map(|a| {
            let (n, t) = (&a.name, &a.ty);
            quote_spanned!(t.span()=> let #out = #krate::__private::push_arg::<#t>(#out, &#n, #q)?;)
        });
        let call = match m.args.iter().find(|a| a.bulk) {
            // The bulk value goes as it is (lent when large); the other arguments and the
            // trailer follow it as the request's tail.
            Some(b) => {
                let b = &b.name;
                quote! {{
                    let #out = ::std::vec::Vec::new();
                    #(#pushes)*
                    let #payload = #krate::__private::end_bulk(#out, #krate::Bulk::len(&#b));
                    self.#inner
                        .call_bulk(#id, #b, #payload, ::core::clone::Clone::clone(&self.#options))
                        .await?
                }}
            }
            None => quote! {{
                let #out = ::std::vec::Vec::new();
                #(#pushes)*
                self.#inner
                    .call(#id, #out, ::core::clone::Clone::clone(&self.#options))
                    .await?
            }},
        };
        let decode = if m.ret_bulk {
            quote!(::core::result::Result::Ok(<#krate::Bulk as ::core::convert::From<#krate::Body>>::from(#response)))
        } else {
            quote_spanned!(ret.span()=> #krate::__private::decode_ret::<#ret>(&#response.bytes(), #q))
        };
        quote! {
            #(#attrs)*
            pub async fn #name(&self, #(#params),*) -> ::core::result::Result<#ret, #krate::RpcError> {
                let #response = #call;
                let #out = #decode;
                #out
            }
        }
    });
    quote! {
        #[doc = #doc]
        #[derive(::core::clone::Clone)]
        #vis struct #client {
            #inner: #krate::__private::Caller,
            #options: #krate::CallOptions,
        }

        impl #client {
            /// Each method's name and its id on the wire.
            pub const METHOD_IDS: &'static [(&'static str, u32)] = &[#(#ids),*];

            /// A typed client over an existing connection.
            pub fn new(inner: #krate::Client) -> Self {
                Self { #inner: #krate::__private::Caller::Client(inner), #options: ::core::default::Default::default() }
            }

            /// A typed client over a `Channel`: it connects again when its connection is lost
            /// or its server shuts down (see `Channel`).
            pub fn from_channel(channel: #krate::Channel) -> Self {
                Self { #inner: #krate::__private::Caller::Channel(channel), #options: ::core::default::Default::default() }
            }

            /// Connects to a server at `addr` on `device` (see `Client::connect`).
            ///
            /// # Errors
            /// As `Client::connect`: the transport's, or a peer that is not an rdma-rpc server.
            pub async fn connect(
                device: &#krate::transport::Device,
                addr: ::std::net::SocketAddr,
                config: #krate::Config,
            ) -> ::core::result::Result<Self, #krate::RpcError> {
                ::core::result::Result::Ok(Self::new(#krate::Client::connect(device, addr, config).await?))
            }

            /// A client on the same connection whose calls all use `options` (deadline,
            /// response-size hint).
            pub fn with_options(&self, options: #krate::CallOptions) -> Self {
                Self { #inner: ::core::clone::Clone::clone(&self.#inner), #options: options }
            }

            /// The options every call of this client uses.
            pub fn options(&self) -> &#krate::CallOptions {
                &self.#options
            }

            /// The byte-level client underneath; `None` for one over a `Channel` (see
            /// `channel`).
            pub fn inner(&self) -> ::core::option::Option<&#krate::Client> {
                match &self.#inner {
                    #krate::__private::Caller::Client(c) => ::core::option::Option::Some(c),
                    #krate::__private::Caller::Channel(_) => ::core::option::Option::None,
                }
            }

            /// The `Channel` underneath, for one made with `from_channel`.
            pub fn channel(&self) -> ::core::option::Option<&#krate::Channel> {
                match &self.#inner {
                    #krate::__private::Caller::Channel(c) => ::core::option::Option::Some(c),
                    #krate::__private::Caller::Client(_) => ::core::option::Option::None,
                }
            }

            #(#methods)*
        }
    }
}

fn server(s: &Service) -> TokenStream {
    let krate = &s.krate;
    let vis = &s.item.vis;
    let tr = &s.item.ident;
    let server = format_ident!("{}Server", tr);
    let doc = format!(
        "Serves any implementation of [`{tr}`]: registers one handler per method on a \
         `ServerBuilder`, or binds a `Server` directly."
    );
    let (service, request, ret, builder) = (local("service"), local("request"), local("ret"), local("builder"));
    let (bulk_local, args_local) = (local("bulk"), local("args"));
    let (bulk_len, end, bytes) = (local("bulk_len"), local("end"), local("bytes"));
    let handlers = s.methods.iter().map(|m| {
        let (name, id) = (&m.name, m.id);
        let q = qualname(s, m);
        // The handler's arguments in declaration order: the bulk value, or the next argument
        // taken off the request, each at its type's span (generated names, so the user's
        // argument names never meet them).
        let names: Vec<Ident> = (0..m.args.len()).map(|i| local(&format!("arg{i}"))).collect();
        let call_args: Vec<TokenStream> = m
            .args
            .iter()
            .zip(&names)
            .map(|(a, n)| if a.bulk { quote!(#bulk_local) } else { quote!(#n) })
            .collect();
        let takes = m.args.iter().zip(&names).filter(|(a, _)| !a.bulk).map(|(a, n)| {
            let t = &a.ty;
            quote_spanned!(t.span()=> let #n = #krate::__private::take_arg::<#t>(&mut #args_local, #q)?;)
        });
        let taken: Vec<&Ident> = m
            .args
            .iter()
            .zip(&names)
            .filter(|(a, _)| !a.bulk)
            .map(|(_, n)| n)
            .collect();
        // The arguments are decoded from the request where it is (its receive slot, or the
        // buffer it was read into), under a read borrow that ends before the method runs; a
        // bulk argument stays there, a request without one is let go at once.
        let decode = if m.args.iter().any(|a| a.bulk) {
            quote! {
                let (#bulk_len, #(#taken,)*) = {
                    let #bytes = #request.bytes();
                    let (#bulk_len, #end) = #krate::__private::bulk_layout(&#bytes, #q)?;
                    let mut #args_local: &[u8] = &#bytes[#bulk_len..#end];
                    #(#takes)*
                    #krate::__private::end_args(#args_local, #q)?;
                    (#bulk_len, #(#taken,)*)
                };
                let #bulk_local = #krate::__private::into_bulk(#request, #bulk_len);
            }
        } else {
            let check = quote! {
                let #bytes = #request.bytes();
                let mut #args_local: &[u8] = &#bytes;
                #(#takes)*
                #krate::__private::end_args(#args_local, #q)?;
            };
            // No arguments: the request is only checked to be empty (no unit binding).
            let bind = if taken.is_empty() {
                quote!({ #check })
            } else {
                quote!(let (#(#taken,)*) = { #check (#(#taken,)*) };)
            };
            quote! {
                #bind
                ::core::mem::drop(#request);
            }
        };
        let ret_ty = &m.ret;
        let encode = if m.ret_bulk {
            quote!(::core::result::Result::Ok(#krate::core::TypedAnswer::Bulk(#ret)))
        } else {
            quote_spanned!(ret_ty.span()=> #krate::__private::encode_answer::<#ret_ty>(&#ret, #q))
        };
        quote! {
            let #builder = {
                let #service = ::core::clone::Clone::clone(&self.#service);
                #builder.handler_typed(#id, move |#request: #krate::Body| {
                    let #service = ::core::clone::Clone::clone(&#service);
                    async move {
                        #decode
                        let #ret = <S as #tr>::#name(&*#service, #(#call_args),*).await;
                        #encode
                    }
                })
            };
        }
    });
    quote! {
        #[doc = #doc]
        #vis struct #server<S> {
            #service: ::std::sync::Arc<S>,
        }

        impl<S> ::core::clone::Clone for #server<S> {
            fn clone(&self) -> Self {
                Self { #service: ::core::clone::Clone::clone(&self.#service) }
            }
        }

        impl<S> #server<S>
        where
            S: #tr + ::core::marker::Send + ::core::marker::Sync + 'static,
        {
            /// Serves `service`.
            pub fn new(service: S) -> Self {
                Self { #service: ::std::sync::Arc::new(service) }
            }

            /// Serves a service value shared with other code.
            pub fn from_arc(service: ::std::sync::Arc<S>) -> Self {
                Self { #service: service }
            }

            /// Adds one handler per method to `builder` (other services may share it: ids are
            /// derived from the trait's name too).
            pub fn register(&self, builder: #krate::ServerBuilder) -> #krate::ServerBuilder {
                let #builder = builder;
                #(#handlers)*
                #builder
            }

            /// Binds a server for this service alone on `addr` (port 0 picks one); run it with
            /// `Server::serve`, or `Server::serve_with_shutdown` for one that stops gracefully.
            ///
            /// # Errors
            /// As `ServerBuilder::bind`: the address cannot be bound.
            pub fn bind(
                &self,
                device: &#krate::transport::Device,
                addr: ::std::net::SocketAddr,
                config: #krate::Config,
            ) -> ::core::result::Result<#krate::Server, #krate::RpcError> {
                self.register(#krate::Server::builder(config)).bind(device, addr)
            }
        }
    }
}
