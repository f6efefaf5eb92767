package config

import "reflect"

func reflectFile() reflect.Type { return reflect.TypeOf(file{}) }
