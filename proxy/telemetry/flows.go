package telemetry

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"aether.io/node/pkg/flowapi"
)

// Bounds of the flows hub.
const (
	// FlowQueue is each subscriber's queue, in events: when it is full,
	// what comes is dropped for that subscriber (counted), never waited
	// for.
	FlowQueue = 4096
	// MaxFlowSubscribers is how many subscribers may follow at once. With
	// FlowQueue it bounds what the hub holds: at most 8 × 4096 events (a
	// connection's description, ~670 bytes each: ~21 MiB).
	MaxFlowSubscribers = 8
	// FlowNoticeInterval is how often, at most, a subscriber whose queue
	// never empties is told how many events it lost; one whose queue
	// empties is told then.
	FlowNoticeInterval = time.Second
)

// ErrTooManySubscribers is Subscribe's error when MaxFlowSubscribers
// follow already.
var ErrTooManySubscribers = fmt.Errorf("too many flow subscribers: %d at once at most", MaxFlowSubscribers)

// ErrSubscriptionClosed is Next's error after Close.
var ErrSubscriptionClosed = errors.New("flow subscription closed")

// Flows is the hub of the proxy's connection events, which the flows
// socket streams (`aetherctl flows`): each connection's open (a light
// event: no end, bytes or reason), its close (the full event: the access
// log's fields), and each refused or misdirected connection (a close
// only). Every subscriber has its own filter and its own bounded queue; an
// event is offered to the subscribers whose filter it matches, and dropped
// (counted: aether_proxy_flow_events_dropped_total and the subscriber's
// own count, which it is told in-band) for one whose queue is full.
// Publishing never blocks and never waits for a reader; with no subscriber
// it costs one atomic load and allocates nothing.
type Flows struct {
	// subs is the current subscribers, replaced as a whole (copy on
	// write); nil when there is none.
	subs atomic.Pointer[[]*Subscription]
	// mu serializes Subscribe and Close.
	mu       sync.Mutex
	dropped  prometheus.Counter
	rejected prometheus.Counter
}

// flowRecord is one published event as queued: the connection's
// description copied, formatted only by the subscriber that takes it.
type flowRecord struct {
	info         ConnInfo
	start, end   time.Time
	toDst, toSrc int64
	reason       CloseReason
	err          error
}

func newFlows(reg prometheus.Registerer) *Flows {
	f := &Flows{
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_proxy_flow_events_dropped_total",
			Help: "Connection events not sent to a flows subscriber (aetherctl flows) because its queue was full (4096 events): the subscriber reads more slowly than connections come.",
		}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_proxy_flow_peers_rejected_total",
			Help: "Connections to the flows socket refused because the peer's uid (SO_PEERCRED) is not allowed.",
		}),
	}
	reg.MustRegister(f.dropped, f.rejected, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aether_proxy_flow_subscribers",
		Help: "Clients following the flows socket now.",
	}, func() float64 { return float64(f.Subscribers()) }))
	return f
}

// Subscribers returns how many subscribers follow now.
func (f *Flows) Subscribers() int {
	if s := f.subs.Load(); s != nil {
		return len(*s)
	}
	return 0
}

// PeerRejected counts a flows-socket peer whose uid is not allowed.
func (f *Flows) PeerRejected() { f.rejected.Inc() }

// active reports a subscriber: the data path's one atomic load.
func (f *Flows) active() bool { return f.subs.Load() != nil }

// publish offers one event to every subscriber whose filter it matches:
// an open when end is zero, else a close with reason. The record is made
// once, for the first match, and shared.
func (f *Flows) publish(info *ConnInfo, start, end time.Time, toDst, toSrc int64, reason CloseReason, err error) {
	subs := f.subs.Load()
	if subs == nil {
		return
	}
	denied := !end.IsZero() && (reason == ReasonDenied || info.PolicyDecision == PolicyDeny)
	var r *flowRecord
	for _, s := range *subs {
		if !s.filter.match(info, denied) {
			continue
		}
		if len(s.ch) == cap(s.ch) {
			// Full: dropped without making the record (a reader that
			// never reads costs a connection no allocation).
			s.drop()
			continue
		}
		if r == nil {
			r = &flowRecord{info: *info, start: start, end: end, toDst: toDst, toSrc: toSrc, reason: reason, err: err}
		}
		select {
		case s.ch <- r:
		default:
			s.drop()
		}
	}
}

// flowFilter is a flowapi.Request split for matching on the data path.
type flowFilter struct {
	podNS, podName string
	namespace      string
	denied         bool
	serviceHost    string
	svcNS, svcName string
	reporter       string
}

func newFlowFilter(req flowapi.Request) flowFilter {
	f := flowFilter{namespace: req.Namespace, denied: req.Denied, reporter: req.Reporter}
	if req.Pod != "" {
		f.podNS, f.podName, _ = flowapi.SplitPod(req.Pod)
	}
	if ns, name, ok := strings.Cut(req.Service, "/"); ok {
		f.svcNS, f.svcName = ns, name
	} else {
		f.serviceHost = req.Service
	}
	return f
}

// match reports whether the event of i (denied: a close a policy refused;
// an open never is) passes every filter set.
func (f *flowFilter) match(i *ConnInfo, denied bool) bool {
	src, dst := &i.Source, &i.Destination
	switch {
	case f.reporter != "" && i.Reporter != f.reporter,
		f.denied && !denied,
		f.namespace != "" && src.Namespace != f.namespace && dst.Namespace != f.namespace,
		f.podName != "" && (src.Namespace != f.podNS || src.Name != f.podName) && (dst.Namespace != f.podNS || dst.Name != f.podName),
		f.serviceHost != "" && i.Service.Hostname != f.serviceHost,
		f.svcName != "" && (i.Service.Namespace != f.svcNS || i.Service.Name != f.svcName):
		return false
	}
	return true
}

// Subscription is one subscriber of a Flows hub: its filter and its queue.
// Next and Pending are for one reader goroutine; Close may be called from
// any.
type Subscription struct {
	f      *Flows
	filter flowFilter
	ch     chan *flowRecord
	// dropped counts the events dropped since the last notice.
	dropped    atomic.Uint64
	lastNotice time.Time
	done       chan struct{}
	closeOnce  sync.Once
}

// Subscribe adds a subscriber of the events matching req, queueing up to
// FlowQueue of them; Close removes it. It fails on an invalid request and
// with ErrTooManySubscribers.
func (f *Flows) Subscribe(req flowapi.Request) (*Subscription, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	s := &Subscription{f: f, filter: newFlowFilter(req), ch: make(chan *flowRecord, FlowQueue), done: make(chan struct{})}
	f.mu.Lock()
	defer f.mu.Unlock()
	var cur []*Subscription
	if p := f.subs.Load(); p != nil {
		cur = *p
	}
	if len(cur) >= MaxFlowSubscribers {
		return nil, ErrTooManySubscribers
	}
	next := append(cur[:len(cur):len(cur)], s)
	f.subs.Store(&next)
	return s, nil
}

// Close removes the subscriber: nothing more is queued for it, and Next
// returns ErrSubscriptionClosed.
func (s *Subscription) Close() {
	s.closeOnce.Do(func() {
		f := s.f
		f.mu.Lock()
		defer f.mu.Unlock()
		var next []*Subscription
		for _, o := range *f.subs.Load() {
			if o != s {
				next = append(next, o)
			}
		}
		if len(next) == 0 {
			f.subs.Store(nil)
		} else {
			f.subs.Store(&next)
		}
		close(s.done)
	})
}

// drop counts one event dropped for s.
func (s *Subscription) drop() {
	s.dropped.Add(1)
	s.f.dropped.Inc()
}

// Pending reports an event or a drop notice ready for Next without
// waiting.
func (s *Subscription) Pending() bool { return len(s.ch) > 0 || s.dropped.Load() > 0 }

// Next returns the subscriber's next message, waiting for one until ctx
// ends or Close: an event (TypeOpened, TypeClosed), or a TypeDropped
// notice of the events dropped since the previous one, sent when the
// queue is empty (the reader caught up) or, while it is not, at most every
// FlowNoticeInterval.
func (s *Subscription) Next(ctx context.Context) (flowapi.Message, error) {
	select {
	case <-s.done:
		return flowapi.Message{}, ErrSubscriptionClosed
	default:
	}
	if s.dropped.Load() > 0 && (len(s.ch) == 0 || time.Since(s.lastNotice) >= FlowNoticeInterval) {
		s.lastNotice = time.Now()
		return flowapi.Message{Type: flowapi.TypeDropped, Dropped: s.dropped.Swap(0)}, nil
	}
	select {
	case r := <-s.ch:
		return r.message(), nil
	case <-ctx.Done():
		return flowapi.Message{}, ctx.Err()
	case <-s.done:
		return flowapi.Message{}, ErrSubscriptionClosed
	}
}

// message formats the record as the flows socket sends it.
func (r *flowRecord) message() flowapi.Message {
	ev := newEvent(&r.info, r.start, r.end, r.toDst, r.toSrc, r.reason, r.err)
	t := flowapi.TypeClosed
	if r.end.IsZero() {
		t = flowapi.TypeOpened
	}
	return flowapi.Message{Type: t, Event: &ev}
}
