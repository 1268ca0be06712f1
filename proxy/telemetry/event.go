package telemetry

import (
	"log/slog"
	"reflect"
	"strings"
	"time"

	"aether.io/node/pkg/flowapi"
)

// newEvent is the one description of a connection that the access log
// writes and the flows socket streams: i as its reporter saw it, from start
// to end (zero: it just opened, so no end, bytes, reason or flags), toDst
// and toSrc bytes each way, closed with reason and err (nil: a clean end).
func newEvent(i *ConnInfo, start, end time.Time, toDst, toSrc int64, reason CloseReason, err error) flowapi.Event {
	ev := flowapi.Event{
		Reporter:     i.Reporter,
		StartTime:    start.UTC().Format(time.RFC3339Nano),
		SrcWorkload:  i.Source.Workload,
		SrcPod:       i.Source.Name,
		SrcNamespace: i.Source.Namespace,
		DstWorkload:  i.Destination.Workload,
		DstPod:       i.Destination.Name,
		DstNamespace: i.Destination.Namespace,
		DstService:   i.Service.Hostname,
		BytesToDst:   toDst,
		BytesToSrc:   toSrc,
		Path:         i.Path,
		Security:     SecurityNone,
		Policy:       i.Policy,
		PolicyReason: i.PolicyReason,
		PolicyDryRun: i.PolicyDryRun,
		Limit:        i.Limit,
	}
	if i.Src.IsValid() {
		ev.SrcAddr = i.Src.String()
	}
	if i.Dst.IsValid() {
		ev.DstAddr = i.Dst.String()
	}
	if i.MTLS {
		// Only what mutual TLS proved (ztunnel logs the same).
		ev.Security, ev.SrcPrincipal, ev.DstPrincipal = SecurityMutualTLS, i.SourcePrincipal, i.DestinationPrincipal
	}
	closed := !end.IsZero()
	ev.PolicyDecision = i.PolicyDecision
	if ev.PolicyDecision == "" {
		ev.PolicyDecision = PolicyNone
		if closed && reason == ReasonDenied {
			ev.PolicyDecision = PolicyDeny
		}
	}
	if closed {
		ev.EndTime, ev.DurationMS = end.UTC().Format(time.RFC3339Nano), float64(end.Sub(start).Microseconds())/1000
		ev.Reason, ev.ResponseFlags = reason.String(), reason.Flag()
	}
	if err != nil {
		ev.Error = err.Error()
	}
	return ev
}

// eventField is one field of flowapi.Event as an access-log key: its JSON
// name and its index.
type eventField struct {
	key   string
	index int
	kind  reflect.Kind
}

// eventFields are flowapi.Event's fields in order, read once from the
// type: the access log's keys are the event's JSON names by construction.
var eventFields = func() []eventField {
	t := reflect.TypeFor[flowapi.Event]()
	out := make([]eventField, 0, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		key, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		out = append(out, eventField{key: key, index: i, kind: f.Type.Kind()})
	}
	return out
}()

// eventAttrs returns ev's fields as slog attributes, keyed and ordered as
// its JSON.
func eventAttrs(ev *flowapi.Event) []slog.Attr {
	v := reflect.ValueOf(ev).Elem()
	out := make([]slog.Attr, len(eventFields))
	for n, f := range eventFields {
		fv := v.Field(f.index)
		switch f.kind {
		case reflect.String:
			out[n] = slog.String(f.key, fv.String())
		case reflect.Int64:
			out[n] = slog.Int64(f.key, fv.Int())
		case reflect.Float64:
			out[n] = slog.Float64(f.key, fv.Float())
		default:
			out[n] = slog.Any(f.key, fv.Interface())
		}
	}
	return out
}
