//! The state store against a real etcd (Debian's `etcd-server`, installed on first use): the
//! election, fencing, the record, a standby taking over, and etcd going away and coming back.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "support/etcd.rs"]
mod etcd;

use std::time::{Duration, Instant};

use etcd::Etcd;
use hvd_store::{Campaign, Leader, LeaseState, Store, StoreError, StoreUrl};

const T: Duration = Duration::from_secs(5);

fn me(id: &str) -> Leader {
    Leader {
        id: id.into(),
        address: format!("127.0.0.1:{}", 1000 + id.len()),
    }
}

async fn store(e: &Etcd, prefix: &str) -> Store {
    let url: StoreUrl = e.url(prefix).parse().unwrap();
    Store::connect(&url, T, None).await.unwrap()
}

#[tokio::test]
async fn an_unreachable_store_is_named_in_the_error() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url: StoreUrl = format!("etcd://127.0.0.1:{port}/job").parse().unwrap();
    let t = Instant::now();
    let e = Store::connect(&url, Duration::from_secs(1), None)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// Two drivers campaign at once: one wins, the other learns who; the record written by the
/// winner is read back; a driver that resigned can write no more (fencing), and the next
/// one elected reads what the first wrote.
#[tokio::test]
async fn one_driver_acts_and_a_resigned_one_is_fenced() {
    let e = Etcd::start();
    let (a, b) = (store(&e, "jobs/one").await, store(&e, "jobs/one").await);
    let (ma, mb) = (me("a"), me("bb"));
    let (ra, rb) = tokio::join!(a.campaign(&ma, T), b.campaign(&mb, T));
    let (winner, lead, loser, held) = match (ra.unwrap(), rb.unwrap()) {
        (Campaign::Won(l), Campaign::Held(h)) => (&a, l, &b, h),
        (Campaign::Held(h), Campaign::Won(l)) => (&b, l, &a, h),
        other => panic!("not exactly one winner: {other:?}"),
    };
    let winner_id = if std::ptr::eq(winner, &a) { "a" } else { "bb" };
    assert_eq!(held, me(winner_id));
    assert_eq!(loser.leader().await.unwrap(), Some(me(winner_id)));
    assert_eq!(winner.load().await.unwrap(), None);
    winner.save(&lead, b"generation 3").await.unwrap();
    assert_eq!(
        loser.load().await.unwrap().as_deref(),
        Some(&b"generation 3"[..])
    );
    // Another job's prefix is another election.
    let other = store(&e, "jobs/two").await;
    assert!(matches!(
        other.campaign(&me("c"), T).await.unwrap(),
        Campaign::Won(_)
    ));

    let stale = Store::clone(winner);
    winner.resign(lead).await.unwrap();
    let next = match loser.campaign(&me("next"), T).await.unwrap() {
        Campaign::Won(l) => l,
        Campaign::Held(h) => panic!("the resigned driver still holds it: {h:?}"),
    };
    assert_eq!(
        loser.load().await.unwrap().as_deref(),
        Some(&b"generation 3"[..])
    );
    loser.save(&next, b"generation 4").await.unwrap();
    // The old driver's leadership: a fresh campaign shows who acts; and a write with the
    // leadership it had before is refused.
    match stale.campaign(&me("old"), T).await.unwrap() {
        Campaign::Held(h) => assert_eq!(h, me("next")),
        Campaign::Won(_) => panic!("two drivers active"),
    }
    loser.clear(&next).await.unwrap();
    assert_eq!(loser.load().await.unwrap(), None);
}

/// A driver whose lease lapses (it stopped renewing: dead, or cut off) is replaced by a
/// standby within the lease's TTL and a second, and its own writes are refused.
#[tokio::test]
async fn a_standby_takes_over_when_the_lease_lapses() {
    let e = Etcd::start();
    let (a, b) = (
        store(&e, "jobs/standby").await,
        store(&e, "jobs/standby").await,
    );
    let ttl = Duration::from_secs(2);
    let lead = match a.campaign(&me("active"), ttl).await.unwrap() {
        Campaign::Won(l) => l,
        Campaign::Held(h) => panic!("{h:?}"),
    };
    a.save(&lead, b"record").await.unwrap();
    let standby = tokio::spawn(async move {
        let l = b.wait_for_leadership(&me("standby"), ttl).await.unwrap();
        (Instant::now(), b, l)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !standby.is_finished(),
        "the standby took over a live driver"
    );
    // The active driver stops renewing: as if its process died.
    let died = Instant::now();
    let stale_created = a.clone();
    drop(lead);
    let (took_over, b, next) = tokio::time::timeout(Duration::from_secs(10), standby)
        .await
        .expect("the standby never took over")
        .unwrap();
    let failover = took_over - died;
    println!("failover after the lease stopped: {failover:?} (ttl {ttl:?})");
    assert!(failover <= ttl + Duration::from_secs(1), "{failover:?}");
    assert_eq!(b.load().await.unwrap().as_deref(), Some(&b"record"[..]));
    b.save(&next, b"newer").await.unwrap();
    assert_eq!(stale_created.leader().await.unwrap(), Some(me("standby")));
}

/// etcd goes away mid-job: the active driver's writes fail with an error naming the
/// endpoint, and its lease is reported unsure within the TTL (it must hold still, since a
/// standby might be acting); when etcd returns, the lease is held again (etcd extends leases
/// on a restart) and the writes resume. A lease that expires while the driver is cut off is
/// reported lost.
#[tokio::test]
async fn losing_etcd_makes_the_lease_unsure_and_its_return_restores_it() {
    let mut e = Etcd::start();
    let a = store(&e, "jobs/lost").await;
    let ttl = Duration::from_secs(2);
    let lead = match a.campaign(&me("a"), ttl).await.unwrap() {
        Campaign::Won(l) => l,
        Campaign::Held(h) => panic!("{h:?}"),
    };
    a.save(&lead, b"before").await.unwrap();
    e.kill();
    let t = Instant::now();
    let state = tokio::time::timeout(Duration::from_secs(10), lead.changed(&LeaseState::Held))
        .await
        .expect("the unreachable store was never reported");
    assert!(matches!(state, LeaseState::Unsure(_)), "{state:?}");
    assert!(
        t.elapsed() <= ttl + Duration::from_secs(1),
        "{:?}",
        t.elapsed()
    );
    let err = a.save(&lead, b"during").await.unwrap_err();
    assert!(err.to_string().contains(&e.endpoint()), "{err}");
    e.resume();
    let state = tokio::time::timeout(Duration::from_secs(20), lead.changed(&state))
        .await
        .expect("the lease was never renewed after etcd returned");
    assert_eq!(state, LeaseState::Held);
    a.save(&lead, b"after").await.unwrap();
    assert_eq!(a.load().await.unwrap().as_deref(), Some(&b"after"[..]));
    // A standby is refused while this driver holds the lease.
    let b = store(&e, "jobs/lost").await;
    assert!(matches!(
        b.campaign(&me("b"), ttl).await.unwrap(),
        Campaign::Held(_)
    ));
    // Revoked behind its back (as a lapse would): reported lost, and writes are fenced.
    assert!(b.evict_leader().await.unwrap());
    let why = tokio::time::timeout(Duration::from_secs(10), lead.lost())
        .await
        .expect("the expired lease was never reported");
    assert!(why.contains("expired"), "{why}");
    assert!(matches!(
        a.save(&lead, b"late").await.unwrap_err(),
        StoreError::Fenced { .. }
    ));
}

/// An etcd with authentication on: a driver connects as the user the environment names;
/// without credentials, or with a wrong password, it is refused with the endpoint named; a
/// half-given pair is refused before any connection.
#[tokio::test]
async fn an_etcd_with_authentication_takes_the_credentials_it_is_given() {
    use hvd_store::Credentials;
    let e = Etcd::start();
    let mut admin = etcd_client::Client::connect([e.endpoint()], None)
        .await
        .unwrap();
    admin.user_add("root", "root-pw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let url: StoreUrl = e.url("jobs/auth").parse().unwrap();
    let good = Credentials::from_vars(Some("root".into()), Some("root-pw".into()))
        .unwrap()
        .unwrap();
    let s = Store::connect(&url, T, Some(&good)).await.unwrap();
    let lead = match s.campaign(&me("a"), T).await.unwrap() {
        Campaign::Won(l) => l,
        Campaign::Held(h) => panic!("held by {h:?}"),
    };
    s.save(&lead, b"record").await.unwrap();
    assert_eq!(s.load().await.unwrap().as_deref(), Some(&b"record"[..]));
    let wrong = Credentials::from_vars(Some("root".into()), Some("nope".into()))
        .unwrap()
        .unwrap();
    for creds in [None, Some(&wrong)] {
        let err = match Store::connect(&url, T, creds).await {
            Ok(_) => panic!("connected with {creds:?} to an etcd with authentication on"),
            Err(err) => err,
        };
        assert!(err.to_string().contains(&e.endpoint()), "{err}");
    }
    assert!(format!("{good:?}").contains("<hidden>"));
    assert!(!format!("{good:?}").contains("root-pw"));
    let half = Credentials::from_vars(Some("root".into()), None).unwrap_err();
    assert!(
        half.to_string().contains("HVD_STATE_STORE_PASSWORD"),
        "{half}"
    );
}
