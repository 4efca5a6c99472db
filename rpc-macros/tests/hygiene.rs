//! Generated code names only absolute paths: a service compiles inside a
//! `#[no_implicit_prelude]` module, with the facade crate known only as `renamed_rpc` (see
//! this package's dev-dependencies: there is no `rdma_rpc` to fall back on), and with argument
//! names that match the generated code's own locals.

#[no_implicit_prelude]
mod bare {
    /// A service written where nothing is in scope but what it names.
    #[::renamed_rpc::service]
    pub trait Bare {
        /// Arguments named like the generated locals.
        async fn shadow(
            &self,
            service: ::std::string::String,
            request: u32,
            payload: u8,
            inner: u16,
            options: u64,
        ) -> ::std::vec::Vec<u8>;
        /// A bulk argument and a bulk result, named like the locals too.
        async fn bulk(&self, args: u32, bulk: ::renamed_rpc::Bulk) -> ::renamed_rpc::Bulk;
        /// A user error.
        async fn fallible(&self, ret: bool) -> ::core::result::Result<u8, ::std::string::String>;
    }

    /// Implements it.
    pub struct Impl;

    impl Bare for Impl {
        async fn shadow(
            &self,
            service: ::std::string::String,
            request: u32,
            payload: u8,
            inner: u16,
            options: u64,
        ) -> ::std::vec::Vec<u8> {
            let mut v: ::std::vec::Vec<u8> = ::core::convert::From::from(service.as_bytes());
            v.push(request as u8);
            v.push(payload);
            v.push(inner as u8);
            v.push(options as u8);
            v
        }
        async fn bulk(&self, args: u32, bulk: ::renamed_rpc::Bulk) -> ::renamed_rpc::Bulk {
            let mut v = bulk.into_vec();
            v.push(args as u8);
            ::core::convert::From::from(v)
        }
        async fn fallible(&self, ret: bool) -> ::core::result::Result<u8, ::std::string::String> {
            if ret {
                ::core::result::Result::Ok(1)
            } else {
                ::core::result::Result::Err(::core::convert::From::from("no"))
            }
        }
    }
}

#[tokio::test]
async fn a_service_generated_without_prelude_or_crate_name_works() {
    use renamed_rpc::{transport::Device, Config};
    let dev = Device::open("tcp").expect("tcp provider");
    let server = bare::BareServer::new(bare::Impl)
        .bind(&dev, "127.0.0.1:0".parse().expect("addr"), Config::default())
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    let c = bare::BareClient::connect(&dev, addr, Config::default())
        .await
        .expect("connect");
    assert_eq!(
        c.shadow("s".into(), 1, 2, 3, 4).await.expect("shadow"),
        b"s\x01\x02\x03\x04"
    );
    assert_eq!(
        c.bulk(9, vec![7u8; 3].into()).await.expect("bulk").to_vec(),
        [7, 7, 7, 9]
    );
    assert_eq!(c.fallible(true).await.expect("call"), Ok(1));
    assert_eq!(c.fallible(false).await.expect("call"), Err("no".to_string()));
}
