package spiderpool

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// TestDecoderSample: the sample PrepareDecoder decodes names every field of
// WorkloadEndpointStatus and of the types it holds, with an element in
// every list, so that every decoder an answer needs is built by it; and it
// decodes.
func TestDecoderSample(t *testing.T) {
	if err := PrepareDecoder(); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(decoderSample, &m); err != nil {
		t.Fatal(err)
	}
	var check func(path string, typ reflect.Type, v any)
	check = func(path string, typ reflect.Type, v any) {
		for typ.Kind() == reflect.Pointer {
			typ = typ.Elem()
		}
		switch typ.Kind() {
		case reflect.Struct:
			obj, ok := v.(map[string]any)
			if !ok {
				t.Errorf("%s: sample has %T, want an object for %s", path, v, typ)
				return
			}
			for i := range typ.NumField() {
				f := typ.Field(i)
				key, _, _ := strings.Cut(f.Tag.Get("json"), ",")
				if key == "" || key == "-" {
					continue
				}
				fv, ok := obj[key]
				if !ok {
					t.Errorf("%s: sample lacks %q (%s.%s)", path, key, typ.Name(), f.Name)
					continue
				}
				check(path+"."+key, f.Type, fv)
			}
		case reflect.Slice:
			arr, ok := v.([]any)
			if !ok || len(arr) == 0 {
				t.Errorf("%s: sample has %v, want a list with an element", path, v)
				return
			}
			check(path+"[0]", typ.Elem(), arr[0])
		}
	}
	check("answer", reflect.TypeFor[WorkloadEndpointStatus](), m)
}
